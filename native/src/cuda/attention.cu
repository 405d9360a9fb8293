// attention.cu: paged attention of a few query rows over a long paged context, split across the
// keys (flash-decoding style) so a long context still fills the GPU.
//
// Grid: (kv head, key split, query tile). A block stages 32 keys of K and V for its kv head in
// shared memory once and lets every query vector of the tile (query rows x the heads sharing
// that kv head) consume them: each K/V byte is read from memory once per query tile, not once
// per query. Lane j scores key j; softmax is online (running max and sum per query vector); each
// lane accumulates head_dim/32 output dims. A combine kernel merges the splits.
// Masks compare the stamped positions of keys (slot_positions) with the query positions.
#include <algorithm>

#include "ops.cuh"

namespace dflash {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kKeysPerChunk = 32;
constexpr int kMaxQueryVectors = 32;   // per block
constexpr int kMaxHeadDim = 256;
constexpr int kPad = 2;                // bf16 pad per staged K row: odd word stride, no bank conflicts

struct Split {
    float m, l;  // running max and sum of exp for one query vector
};

__device__ __forceinline__ bool visible(int32_t qp, int32_t kp, bool causal, int32_t window) {
    if (causal && kp > qp) return false;
    if (window > 0) {
        if (int64_t(qp) - kp >= window) return false;
        if (!causal && int64_t(kp) - qp >= window) return false;
    }
    return true;
}

// q: [nq, n_heads * hd]; out_part: [splits, nq, n_heads, hd] fp32; ml_part: [splits, nq, n_heads]
__global__ void __launch_bounds__(kWarps * 32)
attention_split_kernel(const bf16 *__restrict__ q, int nq, const int32_t *__restrict__ q_positions,
                       int n_heads, int n_kv_heads, int hd, int rows_per_tile, float scale,
                       bool causal, int32_t window, PagedKeys keys, int64_t keys_per_split,
                       float *out_part, Split *ml_part) {
    extern __shared__ unsigned char smem_raw[];
    const int group = n_heads / n_kv_heads;
    const int kv_head = blockIdx.x, split = blockIdx.y;
    const int row0 = blockIdx.z * rows_per_tile;
    const int n_vec = min(rows_per_tile, nq - row0) * group;
    const int ks = hd + kPad;
    float *q_s = reinterpret_cast<float *>(smem_raw);                 // [kMaxQueryVectors][hd]
    bf16 *k_s = reinterpret_cast<bf16 *>(q_s + kMaxQueryVectors * hd); // [32][hd + pad]
    bf16 *v_s = k_s + kKeysPerChunk * ks;                              // [32][hd + pad]
    int32_t *kpos_s = reinterpret_cast<int32_t *>(v_s + kKeysPerChunk * ks);  // [32]

    // query vector v: row row0 + v / group, head kv_head * group + v % group
    for (int i = threadIdx.x; i < n_vec * hd; i += blockDim.x) {
        const int v = i / hd, d = i % hd;
        const int row = row0 + v / group, head = kv_head * group + v % group;
        q_s[v * hd + d] = to_float(q[int64_t(row) * n_heads * hd + int64_t(head) * hd + d]) * scale;
    }

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int kVecPerWarp = kMaxQueryVectors / kWarps;
    constexpr int kDimsPerLane = kMaxHeadDim / 32;
    float o[kVecPerWarp][kDimsPerLane];
    float m[kVecPerWarp], l[kVecPerWarp];
    int32_t qpos[kVecPerWarp];
#pragma unroll
    for (int t = 0; t < kVecPerWarp; ++t) {
        m[t] = -INFINITY;
        l[t] = 0.f;
        const int v = warp * kVecPerWarp + t;
        qpos[t] = v < n_vec ? q_positions[row0 + v / group] : 0;
#pragma unroll
        for (int d = 0; d < kDimsPerLane; ++d) o[t][d] = 0.f;
    }

    const int64_t key_begin = int64_t(split) * keys_per_split;
    const int64_t key_end = min(keys.num_keys, key_begin + keys_per_split);
    const int64_t kv_width = int64_t(n_kv_heads) * hd;
    const bf16 *kc = static_cast<const bf16 *>(keys.k_cache);
    const bf16 *vc = static_cast<const bf16 *>(keys.v_cache);
    for (int64_t chunk = key_begin; chunk < key_end; chunk += kKeysPerChunk) {
        const int n_keys = int(min(int64_t(kKeysPerChunk), key_end - chunk));
        __syncthreads();  // the previous chunk is consumed
        for (int i = threadIdx.x; i < kKeysPerChunk * hd; i += blockDim.x) {
            const int j = i / hd, d = i % hd;
            if (j < n_keys) {
                const int64_t ring = (keys.first_key + chunk + j) % keys.ring_slots;
                const int64_t slot = int64_t(keys.block_table[ring / keys.block_size]) * keys.block_size +
                                     ring % keys.block_size;
                k_s[j * ks + d] = kc[slot * kv_width + int64_t(kv_head) * hd + d];
                v_s[j * ks + d] = vc[slot * kv_width + int64_t(kv_head) * hd + d];
                if (d == 0) kpos_s[j] = keys.slot_positions[ring];
            } else {
                k_s[j * ks + d] = to_bf16(0.f);
                v_s[j * ks + d] = to_bf16(0.f);
            }
        }
        __syncthreads();
#pragma unroll
        for (int t = 0; t < kVecPerWarp; ++t) {
            const int v = warp * kVecPerWarp + t;
            if (v >= n_vec) break;  // warp-uniform
            float score = -INFINITY;
            if (lane < n_keys && visible(qpos[t], kpos_s[lane], causal, window)) {
                const float *qv = q_s + v * hd;
                const __nv_bfloat162 *kr = reinterpret_cast<const __nv_bfloat162 *>(k_s + lane * ks);
                float s = 0.f;
                for (int d = 0; d < hd / 2; ++d) {
                    const float2 kf = __bfloat1622float2(kr[d]);
                    s = fmaf(qv[2 * d], kf.x, s);
                    s = fmaf(qv[2 * d + 1], kf.y, s);
                }
                score = s;
            }
            const float chunk_max = warp_max(score);
            const float new_m = fmaxf(m[t], chunk_max);
            if (new_m == -INFINITY) continue;  // nothing visible yet
            const float p = score == -INFINITY ? 0.f : __expf(score - new_m);
            const float correction = m[t] == -INFINITY ? 0.f : __expf(m[t] - new_m);
            l[t] = l[t] * correction + warp_sum(p);
            m[t] = new_m;
#pragma unroll
            for (int di = 0; di < kDimsPerLane; ++di) o[t][di] *= correction;
            for (int j = 0; j < n_keys; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int di = 0; di < kDimsPerLane; ++di) {
                    const int d = lane + 32 * di;
                    if (d < hd) o[t][di] = fmaf(pj, to_float(v_s[j * ks + d]), o[t][di]);
                }
            }
        }
    }

#pragma unroll
    for (int t = 0; t < kVecPerWarp; ++t) {
        const int v = warp * kVecPerWarp + t;
        if (v >= n_vec) break;
        const int row = row0 + v / group, head = kv_head * group + v % group;
        const int64_t idx = (int64_t(split) * nq + row) * n_heads + head;
#pragma unroll
        for (int di = 0; di < kDimsPerLane; ++di) {
            const int d = lane + 32 * di;
            if (d < hd) out_part[idx * hd + d] = o[t][di];
        }
        if (lane == 0) ml_part[idx] = Split{m[t], l[t]};
    }
}

// One block per (row, head): merges the splits and writes bf16.
__global__ void attention_combine_kernel(const float *out_part, const Split *ml_part, int splits,
                                         int nq, int n_heads, int hd, bf16 *out) {
    const int64_t idx = blockIdx.x;  // row * n_heads + head
    float best = -INFINITY;
    for (int s = 0; s < splits; ++s) best = fmaxf(best, ml_part[s * int64_t(nq) * n_heads + idx].m);
    float total = 0.f;
    for (int s = 0; s < splits; ++s) {
        const Split sp = ml_part[s * int64_t(nq) * n_heads + idx];
        if (sp.m != -INFINITY) total += sp.l * __expf(sp.m - best);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < splits; ++s) {
            const int64_t part = s * int64_t(nq) * n_heads + idx;
            const Split sp = ml_part[part];
            if (sp.m != -INFINITY) acc += out_part[part * hd + d] * __expf(sp.m - best);
        }
        out[idx * hd + d] = to_bf16(total > 0.f ? acc / total : 0.f);
    }
}

struct Plan {
    int rows_per_tile, q_tiles, splits;
    int64_t keys_per_split;
};

Plan plan(int64_t nq, int64_t n_heads, int64_t n_kv_heads, int64_t num_keys) {
    Plan p;
    const int64_t group = n_heads / n_kv_heads;
    p.rows_per_tile = int(std::max<int64_t>(1, kMaxQueryVectors / group));
    p.q_tiles = int((nq + p.rows_per_tile - 1) / p.rows_per_tile);
    // Enough blocks to cover the H200's 132 SMs twice, but at least 64 keys per split.
    const int64_t want = std::max<int64_t>(1, 264 / std::max<int64_t>(1, n_kv_heads * p.q_tiles));
    const int64_t max_splits = std::max<int64_t>(1, (num_keys + 63) / 64);
    p.splits = int(std::min(want, max_splits));
    p.keys_per_split = (num_keys + p.splits - 1) / p.splits;
    p.keys_per_split = (p.keys_per_split + kKeysPerChunk - 1) / kKeysPerChunk * kKeysPerChunk;
    p.splits = int((num_keys + p.keys_per_split - 1) / p.keys_per_split);
    return p;
}

size_t smem_bytes(int64_t hd) {
    return kMaxQueryVectors * hd * sizeof(float) + 2 * kKeysPerChunk * (hd + kPad) * sizeof(bf16) +
           kKeysPerChunk * sizeof(int32_t);
}

}  // namespace

size_t attention_scratch_bytes(int64_t nq, int64_t n_heads, int64_t head_dim, int64_t num_keys,
                               int64_t n_kv_heads) {
    const Plan p = plan(nq, n_heads, n_kv_heads, num_keys);
    const size_t parts = size_t(p.splits) * size_t(nq) * size_t(n_heads);
    return parts * size_t(head_dim) * sizeof(float) + parts * sizeof(Split) + 16;
}

void attention(const bf16 *q, int64_t nq, const int32_t *q_positions, int64_t n_heads,
               int64_t n_kv_heads, int64_t head_dim, float scale, AttentionMask mask,
               const PagedKeys &keys, void *scratch, bf16 *out, cudaStream_t s) {
    if (nq == 0) return;
    if (head_dim > kMaxHeadDim || head_dim % 2)
        fail(DFLASH_STATUS_NOT_SUPPORTED, "cuda attention: head_dim ", head_dim,
             " (supported: even, up to ", kMaxHeadDim, ")");
    if (n_heads / n_kv_heads > kMaxQueryVectors)
        fail(DFLASH_STATUS_NOT_SUPPORTED, "cuda attention: ", n_heads / n_kv_heads,
             " query heads per kv head (supported: up to ", kMaxQueryVectors, ")");
    if (keys.num_keys < 1) fail(DFLASH_STATUS_INTERNAL, "cuda attention: no keys");
    const Plan p = plan(nq, n_heads, n_kv_heads, keys.num_keys);
    const size_t parts = size_t(p.splits) * size_t(nq) * size_t(n_heads);
    float *out_part = static_cast<float *>(scratch);
    // Split records after the partial outputs, 8-byte aligned.
    auto *ml_part = reinterpret_cast<Split *>(
        (reinterpret_cast<uintptr_t>(out_part + parts * size_t(head_dim)) + 7) & ~uintptr_t(7));
    const size_t smem = smem_bytes(head_dim);
    static bool raised = false;  // the opt-in for more than 48 KB of dynamic shared memory
    if (!raised) {
        DFLASH_CUDA_CHECK(cudaFuncSetAttribute(attention_split_kernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(smem_bytes(kMaxHeadDim))));
        raised = true;
    }
    const dim3 grid(unsigned(n_kv_heads), unsigned(p.splits), unsigned(p.q_tiles));
    attention_split_kernel<<<grid, kWarps * 32, smem, s>>>(
        q, int(nq), q_positions, int(n_heads), int(n_kv_heads), int(head_dim), p.rows_per_tile,
        scale, mask.causal, mask.window, keys, p.keys_per_split, out_part, ml_part);
    DFLASH_CUDA_LAUNCHED();
    attention_combine_kernel<<<unsigned(nq * n_heads), 128, 0, s>>>(
        out_part, ml_part, p.splits, int(nq), int(n_heads), int(head_dim), out);
    DFLASH_CUDA_LAUNCHED();
}

}  // namespace cuda
}  // namespace dflash
