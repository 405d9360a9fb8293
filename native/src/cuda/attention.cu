// attention.cu: paged attention of a few query rows over a long paged context, split across the
// keys (flash-decoding style) so a long context still fills the GPU.
//
// Grid: (kv head, key split, query tile); split s reads the key chunks s, s + splits, ... (grid_splits()).
// A block stages 32 keys of K and V for its kv head in shared memory once and lets every query
// vector of the tile (query rows x the heads sharing that kv head) consume them: each K/V byte is
// read from memory once per query tile, not once per query. Lane j scores key j; softmax is
// online (running max and sum per query vector); each lane accumulates head_dim/32 output dims.
// A combine kernel merges the splits.
// Masks compare the stamped positions of keys (slot_positions) with the query positions.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "ops.cuh"

namespace dflash {
namespace cuda {
namespace {

#ifdef DFLASH_PHASE_PROBE
DFLASH_PROBE_TABLE(g_probe_attention);  // 0 entry, 1 after the wait, 2 chunk 0 and Q landed, 3 k loop done, 4 end,
                                        // 5 returned without keys; chunk 0: 6 next chunk's staging issued,
                                        // 7 S = Q K^T issued, 8 maxima published, 9 P published (6-9: the
                                        // eight-warp kernel only; the key-quarter one stamps 0-5)
DFLASH_PROBE_TABLE(g_probe_combine);    // 0 entry, 1 after the wait, 2 split records in, 3 end
#endif

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

// How many keys this call sees: from device memory when the caller keeps it there (graphs).
__device__ __forceinline__ int64_t key_count(const PagedKeys &keys) {
    return keys.num_keys_device ? int64_t(*keys.num_keys_device) : keys.num_keys;
}

// Key `logical` (counted from keys.first_key): its ring index and physical cache slot.
__device__ __forceinline__ int64_t key_ring(const PagedKeys &keys, int64_t logical) {
    return (keys.first_key + logical) % keys.ring_slots;
}
__device__ __forceinline__ int64_t key_slot(const PagedKeys &keys, int64_t ring) {
    return int64_t(keys.block_table[ring / keys.block_size]) * keys.block_size + ring % keys.block_size;
}

// q: nq rows at stride ldq of [n_heads * hd]; out_part: [splits, nq, n_heads, hd] fp32;
// ml_part: [splits, nq, n_heads]
__global__ void __launch_bounds__(kWarps * 32)
attention_split_kernel(const bf16 *q, int64_t ldq, int nq, const int32_t *q_positions,
                       int n_heads, int n_kv_heads, int hd, int rows_per_tile, float scale,
                       bool causal, int32_t window, PagedKeys keys, float *out_part, Split *ml_part) {
    pdl_prologue();
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
        q_s[v * hd + d] = to_float(q[int64_t(row) * ldq + int64_t(head) * hd + d]) * scale;
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

    // This block's chunks: split, split + gridDim.y, ... (see grid_splits()).
    const int64_t key_end = key_count(keys), stride = int64_t(gridDim.y) * kKeysPerChunk;
    if (int64_t(split) * kKeysPerChunk >= key_end) return;  // no keys: nothing written, the combine stops before it
    const int64_t kv_width = int64_t(n_kv_heads) * hd;
    const bf16 *kc = static_cast<const bf16 *>(keys.k_cache);
    const bf16 *vc = static_cast<const bf16 *>(keys.v_cache);
    for (int64_t chunk = int64_t(split) * kKeysPerChunk; chunk < key_end; chunk += stride) {
        const int n_keys = int(min(int64_t(kKeysPerChunk), key_end - chunk));
        __syncthreads();  // the previous chunk is consumed
        for (int i = threadIdx.x; i < kKeysPerChunk * hd; i += blockDim.x) {
            const int j = i / hd, d = i % hd;
            if (j < n_keys) {
                const int64_t ring = key_ring(keys, chunk + j), slot = key_slot(keys, ring);
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

// ---------------------------------------------------------------------------------------------
// Tensor-core path (head_dim 64 or 128): FlashAttention-2 style with mma.sync m16n8k16.
// Block = 4 warps over one kv head, one key split and 64 query vectors (a warp owns 16 of them:
// vector v = query row * group + head within the group). Per chunk of 64 keys the block stages K
// and V with 16-byte cp.async copies (the slot of each key computed once), then each warp computes
// S = Q K^T (fp32), the online softmax, and O += P V with P rounded to bf16.

constexpr int kTcWarps = 4;
constexpr int kTcKeys = 64;     // keys per chunk
constexpr int kTcVectors = 16 * kTcWarps;
constexpr int kTcPad = 8;       // bf16 per staged row: 16 bytes, keeps ldmatrix rows aligned

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
}

// The maximum / sum of x over the quad of lanes that hold one mma row (lanes 4g .. 4g + 3): every lane gets it.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
// The online softmax's running max m moved to cover a chunk's maximum cmax; returns the factor the sums so far
// take (exp(m_old - m_new); 0 when nothing was visible before, 1 when nothing is visible yet).
__device__ __forceinline__ float advance_max(float &m, float cmax) {
    const float new_m = fmaxf(m, cmax);
    const float corr = new_m == -INFINITY || m == -INFINITY ? (new_m == -INFINITY ? 1.f : 0.f) : __expf(m - new_m);
    m = new_m;
    return corr;
}

// O's accumulator tiles (c0, c1: row g; c2, c3: row g + 8) times each row's factor.
template <int N>
__device__ __forceinline__ void scale_rows(float (&o)[N][4], const float corr[2]) {
#pragma unroll
    for (int t = 0; t < N; ++t) {
        o[t][0] *= corr[0];
        o[t][1] *= corr[0];
        o[t][2] *= corr[1];
        o[t][3] *= corr[1];
    }
}

// Dynamic shared memory of attention_tc_kernel<HD, S>: S stages of K and V chunks (kTcKeys rows of HD + kTcPad
// bf16 each) and their key positions, then the slots of the chunk being staged.
template <int HD, int CK = kTcKeys>
__host__ __device__ constexpr size_t tc_stage_bytes() { return size_t(2) * CK * (HD + kTcPad) * sizeof(bf16) + CK * sizeof(int32_t); }
template <int HD, int S>
__host__ __device__ constexpr size_t tc_smem_bytes() { return S * tc_stage_bytes<HD>() + kTcKeys * sizeof(int64_t); }

// The stages in a tensor-core kernel's dynamic shared memory (tc_stage_bytes each: K rows, V rows, key positions),
// then the slots of the chunk being staged. CK: keys per chunk (kTcKeys; the key-quarter kernel also 128).
template <int HD, int CK = kTcKeys>
struct TcStages {
    static constexpr int kStride = HD + kTcPad;
    unsigned char *base;
    __device__ bf16 *k(int st) const { return reinterpret_cast<bf16 *>(base + st * tc_stage_bytes<HD, CK>()); }
    __device__ bf16 *v(int st) const { return k(st) + CK * kStride; }
    __device__ int32_t *kpos(int st) const { return reinterpret_cast<int32_t *>(v(st) + CK * kStride); }
    __device__ int64_t *slots(int stages) const {
        return reinterpret_cast<int64_t *>(base + stages * tc_stage_bytes<HD, CK>());
    }
};

// A tensor-core block's key chunks of CK keys (split s: chunks s, s + splits, ...; chunk c holds keys [first(c),
// first(c) + n_keys(c)), first(c) = s * CK + c * stride), staged by kThreads >= CK threads: threads j < CK
// load key j's block-table entry and position for chunk c into registers (load_keys: one chunk ahead, so the
// block-table read never waits in the loop), then its slot into slot_s and its position into the stage
// (stage_keys); stage_kv copies the chunk's K and V rows by 16-byte cp.async, zeros past the last key, every
// piece in flight at once (coherent L2 reads: the caches were written before the block's wait, or are settled).
template <int HD, int kThreads, int CK = kTcKeys>
struct ChunkStager {
    static_assert(kThreads >= CK, "a thread per key of a chunk");
    static constexpr int kStride = HD + kTcPad, kPieces = HD / 8;
    const PagedKeys &keys;
    const bf16 *kc, *vc;  // this kv head's first element in the caches
    int64_t kv_width, first0, stride, key_end;
    int n_chunks;
    int64_t *slot_s;
    int32_t pend_block = -1, pend_pos = 0;
    int64_t pend_ring = 0;

    __device__ ChunkStager(const PagedKeys &k, int kv_head, int n_kv_heads, int split, int64_t end, int64_t *slots)
        : keys(k), kc(static_cast<const bf16 *>(k.k_cache) + int64_t(kv_head) * HD),
          vc(static_cast<const bf16 *>(k.v_cache) + int64_t(kv_head) * HD), kv_width(int64_t(n_kv_heads) * HD),
          first0(int64_t(split) * CK), stride(int64_t(gridDim.y) * CK), key_end(end),
          n_chunks(int((end - int64_t(split) * CK + stride - 1) / stride)), slot_s(slots) {}
    __device__ int n_keys_of(int c) const { return int(min(int64_t(CK), key_end - (first0 + c * stride))); }
    __device__ void load_keys(int c) {
        const int j = threadIdx.x;
        pend_block = -1;
        if (j < CK && c < n_chunks && j < n_keys_of(c)) {
            pend_ring = key_ring(keys, first0 + c * stride + j);
            pend_block = keys.block_table[pend_ring / keys.block_size];
            pend_pos = keys.slot_positions[pend_ring];
        }
    }
    __device__ void stage_keys(int32_t *kpos) {
        const int j = threadIdx.x;
        if (j < CK) {
            const bool ok = pend_block >= 0;
            slot_s[j] = ok ? int64_t(pend_block) * keys.block_size + pend_ring % keys.block_size : -1;
            kpos[j] = ok ? pend_pos : 0;
        }
    }
    // The prologue of chunk 0 (slot_s and the stages' keys also written by this call's threads): its settled keys'
    // K/V before the wait when early (their slots and positions, and the block table, are settled too), then
    // griddepcontrol.wait, then the rest (keys the step's own kernels wrote).
    __device__ void stage_first(bf16 *ks, bf16 *vs, int32_t *kpos, bool early) {
        // Keys below `settled` were written before this chain began (keys.fresh_keys), the rest by its kernels.
        const int64_t fresh = keys.fresh_keys_device ? int64_t(*keys.fresh_keys_device) : keys.fresh_keys;
        const int64_t settled = early ? key_end - fresh : key_end;
        load_keys(0);
        stage_keys(kpos);
        load_keys(1);
        __syncthreads();  // slot_s written
        stage_kv(ks, vs, 0, early ? 1 : 0, settled);
        if (early) {
            pdl_wait();  // the kernels before this one (the step's own keys, q) are done
            DFLASH_PROBE(g_probe_attention, 1);
            if (first0 + CK > settled) stage_kv(ks, vs, 0, 2, settled);
        }
    }
    // part 0: every key of chunk c; 1: only those below `settled`; 2: only the others.
    __device__ void stage_kv(bf16 *ks, bf16 *vs, int c, int part = 0, int64_t settled = 0) const {
        const int64_t first = first0 + c * stride;
        for (int i = threadIdx.x; i < CK * kPieces; i += kThreads) {
            const int j = i / kPieces, piece = i % kPieces;
            if (part != 0 && (first + j < settled) != (part == 1)) continue;
            const int64_t slot = slot_s[j];
            const bool ok = slot >= 0;
            cp_async16(ks + j * kStride + piece * 8, ok ? kc + slot * kv_width + piece * 8 : kc, ok);
            cp_async16(vs + j * kStride + piece * 8, ok ? vc + slot * kv_width + piece * 8 : vc, ok);
        }
    }
};

// S stages (2 or 3): chunk i + S - 1 is staged (cp.async) while chunk i is computed, so a split that reads
// several chunks (long contexts) keeps S - 1 of them in flight. Its keys' slots and positions are loaded into
// registers one chunk earlier still (key_slot's block-table read then never waits in the loop).
template <int HD, int S>
__global__ void __launch_bounds__(kTcWarps * 32)
attention_tc_kernel(const bf16 *q, int64_t ldq, int nq, const int32_t *q_positions,
                    int n_heads, int n_kv_heads, float scale, bool causal, int32_t window,
                    PagedKeys keys, float *out_part, Split *ml_part) {
    static_assert(S >= 2, "one chunk in flight at least");
    pdl_prologue();
    constexpr int kStride = HD + kTcPad;
    constexpr int kSteps = HD / 16;   // k16 steps of Q K^T
    constexpr int kDimTiles = HD / 8; // n8 tiles of O
    extern __shared__ __align__(16) unsigned char tc_smem[];
    const TcStages<HD> sm{tc_smem};
    int64_t *slot_s = sm.slots(S);  // the chunk being staged

    const int group = n_heads / n_kv_heads;
    const int kv_head = blockIdx.x, split = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, qd = lane & 3;
    const int n_vec = nq * group;
    const int vec0 = blockIdx.z * kTcVectors + warp * 16;  // this warp's first query vector

    // Q fragments for the whole kernel; rows g and g + 8 of the warp's 16 vectors.
    uint32_t qa[kSteps][4];
    int32_t qpos[2];
    bool vec_ok[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int v = vec0 + g + 8 * h;
        vec_ok[h] = v < n_vec;
        qpos[h] = vec_ok[h] ? q_positions[v / group] : 0;
    }
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int v = vec0 + g + 8 * h;
            uint32_t lo = 0, hi = 0;
            if (vec_ok[h]) {
                const bf16 *row = q + int64_t(v / group) * ldq +
                                  int64_t(kv_head * group + v % group) * HD + kk * 16 + 2 * qd;
                lo = *reinterpret_cast<const uint32_t *>(row);
                hi = *reinterpret_cast<const uint32_t *>(row + 8);
            }
            qa[kk][h] = lo;      // a0 (row g) / a1 (row g + 8)
            qa[kk][2 + h] = hi;  // a2 / a3
        }

    float o[kDimTiles][4];
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[t][i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    // This block's chunks: split, split + gridDim.y, ... (see grid_splits()).
    const int64_t key_end = key_count(keys);
    if (int64_t(split) * kTcKeys >= key_end) return;  // no keys: nothing written, the combine stops before it
    ChunkStager<HD, kTcWarps * 32> cs(keys, kv_head, n_kv_heads, split, key_end, slot_s);
    const int n_chunks = cs.n_chunks;
    // Prologue: chunks 0 .. S - 2 staged (one cp.async group each, empty past the last chunk).
    cs.load_keys(0);
#pragma unroll
    for (int c = 0; c < S - 1; ++c) {
        if (c > 0) __syncthreads();  // chunk c - 1's copies have read slot_s
        cs.stage_keys(sm.kpos(c));
        cs.load_keys(c + 1);
        __syncthreads();  // slot_s written
        if (c < n_chunks) cs.stage_kv(sm.k(c), sm.v(c), c);
        cp_async_commit();
    }
    for (int i = 0; i < n_chunks; ++i) {
        cp_async_wait<S - 2>();  // this thread's copies of chunk i have landed
        __syncthreads();         // everyone's; and chunk i - 1 is consumed, its stage free; slot_s read
        const int c = i + S - 1, st = c % S;  // the chunk staged now, into chunk i - 1's stage
        cs.stage_keys(sm.kpos(st));
        cs.load_keys(c + 1);
        __syncthreads();  // slot_s written
        if (c < n_chunks) cs.stage_kv(sm.k(st), sm.v(st), c);
        cp_async_commit();
        if (vec0 >= n_vec) continue;  // warp-uniform: this warp has no query vectors
        const int n_keys = cs.n_keys_of(i);
        const bf16 *kst = sm.k(i % S), *vst = sm.v(i % S);
        const int32_t *kpos_st = sm.kpos(i % S);

        // S = Q K^T: 8 key tiles of 8.
        float sc[kTcKeys / 8][4];
#pragma unroll
        for (int nt = 0; nt < kTcKeys / 8; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) sc[nt][i] = 0.f;
            const bf16 *krow = kst + (nt * 8 + g) * kStride + 2 * qd;
#pragma unroll
            for (int kk = 0; kk < kSteps; ++kk) {
                const uint32_t b0 = *reinterpret_cast<const uint32_t *>(krow + kk * 16);
                const uint32_t b1 = *reinterpret_cast<const uint32_t *>(krow + kk * 16 + 8);
                mma_bf16_16816(sc[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
            }
        }
        // Mask, scale, online softmax. c0, c1: row g, keys nt*8 + 2qd (+1); c2, c3: row g + 8.
        float cmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < kTcKeys / 8; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int h = i >> 1, j = nt * 8 + 2 * qd + (i & 1);
                const bool ok = vec_ok[h] && j < n_keys && visible(qpos[h], kpos_st[j], causal, window);
                sc[nt][i] = ok ? sc[nt][i] * scale : -INFINITY;
                cmax[h] = fmaxf(cmax[h], sc[nt][i]);
            }
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) corr[h] = advance_max(m[h], quad_max(cmax[h]));
        float psum[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < kTcKeys / 8; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int h = i >> 1;
                const float p = sc[nt][i] == -INFINITY ? 0.f : __expf(sc[nt][i] - m[h]);
                sc[nt][i] = p;
                psum[h] += p;
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + psum[h];
        scale_rows(o, corr);
        // O += P V: k16 steps over keys; V fragments by ldmatrix.trans from the staged rows.
#pragma unroll
        for (int ks = 0; ks < kTcKeys / 16; ++ks) {
            const uint32_t a0 = pack_bf16(sc[2 * ks][0], sc[2 * ks][1]);
            const uint32_t a1 = pack_bf16(sc[2 * ks][2], sc[2 * ks][3]);
            const uint32_t a2 = pack_bf16(sc[2 * ks + 1][0], sc[2 * ks + 1][1]);
            const uint32_t a3 = pack_bf16(sc[2 * ks + 1][2], sc[2 * ks + 1][3]);
            // lanes 0-7 address keys ks*16 + 0..7, lanes 8-15 keys ks*16 + 8..15 (matrix 1)
            const int key = ks * 16 + (lane & 15);
#pragma unroll
            for (int t = 0; t < kDimTiles; ++t) {
                const uint32_t addr = static_cast<uint32_t>(
                    __cvta_generic_to_shared(vst + key * kStride + t * 8));
                uint32_t b0, b1;
                ldmatrix_x2_trans(addr, b0, b1);
                mma_bf16_16816(o[t], a0, a1, a2, a3, b0, b1);
            }
        }
    }
    if (vec0 >= n_vec) return;

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] = quad_sum(l[h]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int v = vec0 + g + 8 * h;
        if (!vec_ok[h]) continue;
        const int row = v / group, head = kv_head * group + v % group;
        const int64_t idx = (int64_t(split) * nq + row) * n_heads + head;
#pragma unroll
        for (int t = 0; t < kDimTiles; ++t) {
            float2 val = make_float2(o[t][2 * h], o[t][2 * h + 1]);
            *reinterpret_cast<float2 *>(out_part + idx * HD + t * 8 + 2 * qd) = val;
        }
        if (qd == 0) ml_part[idx] = Split{m[h], l[h]};
    }
}

// ---------------------------------------------------------------------------------------------
// Eight-warp tensor-core path (head_dim 64 or 128): the same blocks, chunks and splits as attention_tc_kernel
// (kv head, key split, 64 query vectors; chunks of 64 keys staged by cp.async), but the block's warps share
// every chunk instead of owning 16 vectors each: for S = Q K^T warp w scores keys 8w .. 8w + 7 for all the
// tile's vectors (Q from shared memory by ldmatrix), the chunk's row maxima and sums are merged across the
// warps through shared memory (in warp order), P goes to shared memory as bf16, and for O += P V warp w owns
// head dims w * HD/8 .. +HD/8 for all vectors. So a decode step's 4 vectors keep 8 warps busy (the 4-warp
// kernel ran them on one warp: about 4 000 dependent instructions per chunk, 7-9 us on the H200), and a
// verify's 64 vectors cost each warp a quarter of the mma. Every vector's sums are computed the same way
// whichever vectors share its tile, so a row verified among 16 equals the row decoded alone, bit for bit.
constexpr int kT8Warps = 8;
constexpr int kT8KeysPerWarp = kTcKeys / kT8Warps;  // 8: one n8 tile of S
constexpr int kT8MTiles = kTcVectors / 16;          // 4 m16 tiles of vectors
constexpr int kT8PStride = kTcKeys + 8;             // bf16 per P row: 144 bytes, ldmatrix rows conflict-free
// The phase probe's stamps would take the kernel past 128 registers (one block per SM): a probe build holds it
// to two blocks per SM, as the kernel is without them.
// (An explicit minimum of 1 block is not the same as none: ptxas then took 138 registers.)
#ifdef DFLASH_PHASE_PROBE
#define DFLASH_T8_BOUNDS __launch_bounds__(kT8Warps * 32, 2)
#else
#define DFLASH_T8_BOUNDS __launch_bounds__(kT8Warps * 32)
#endif

template <int HD>
__host__ __device__ constexpr size_t t8_smem_bytes() {
    return 2 * tc_stage_bytes<HD>() + kTcKeys * sizeof(int64_t)                  // 2 stages, slots
           + size_t(kTcVectors) * (HD + kTcPad) * sizeof(bf16)                   // Q tile
           + size_t(kTcVectors) * kT8PStride * sizeof(bf16)                      // P tile
           + 2 * size_t(kTcVectors) * kT8Warps * sizeof(float);                  // row max / sum per warp
}

// The m16n8k16 A fragment of the 16 x 16 bf16 tile at `tile` (rows `stride` elements apart) in shared memory.
__device__ __forceinline__ void ldsm_a(const bf16 *tile, int stride, int lane, uint32_t a[4]) {
    ldmatrix_x4(unsigned(__cvta_generic_to_shared(tile + (lane & 15) * stride + (lane >> 4) * 8)), a[0], a[1], a[2], a[3]);
}

// Query vector v -> (its query row, its head within the kv head's group): a shift and a mask where the group is a
// power of two (every Qwen3 and Llama shape), instead of an integer division on the block's path after the wait.
// (Only the group is kept: its shift is one instruction where used, not a register live through the kernel.)
struct GroupOf {
    int group;
    __device__ explicit GroupOf(int g) : group(g) {}
    __device__ bool pow2() const { return (group & (group - 1)) == 0; }
    __device__ int row(int v) const { return pow2() ? v >> (__ffs(group) - 1) : v / group; }
    __device__ int sub(int v) const { return pow2() ? v & (group - 1) : v % group; }
};

// The eight-warp and key-quarter kernels' entry: lets the next kernel launch, then waits at once unless the keys
// have a settled part (keys.fresh_keys >= 0: chunk 0's settled keys are staged before the wait, in
// ChunkStager::stage_first). Returns whether they have.
__device__ __forceinline__ bool tc_entry(const PagedKeys &keys) {
    const bool early = keys.fresh_keys >= 0;
    DFLASH_PROBE(g_probe_attention, 0);
    pdl_launch_dependents();
    if (!early) {
        pdl_wait();
        DFLASH_PROBE(g_probe_attention, 1);
    }
    return early;
}

// A block's Q tile (m_tiles x 16 vectors from vec_base; zeros past tile_vecs) into q_s (rows of HD + kTcPad),
// 16 bytes per cp.async, in the caller's group (after the wait: q is the rope kernel's): every piece in flight at
// once. (Loaded into a register and stored, one piece after another, a verify's 64 vectors took a thread four L2
// round trips.)
template <int HD, int kThreads>
__device__ __forceinline__ void stage_q_tile(bf16 *q_s, const bf16 *q, int64_t ldq, const GroupOf &gof, int kv_head,
                                             int vec_base, int tile_vecs, int m_tiles) {
    constexpr int kPieces = HD / 8, kStride = HD + kTcPad;
    for (int i = threadIdx.x; i < m_tiles * 16 * kPieces; i += kThreads) {
        const int vl = i / kPieces, piece = i % kPieces, v = vec_base + vl;
        const bool ok = vl < tile_vecs;
        cp_async16(q_s + vl * kStride + piece * 8,
                   ok ? q + int64_t(gof.row(v)) * ldq + int64_t(kv_head * gof.group + gof.sub(v)) * HD + piece * 8
                      : q,
                   ok);
    }
}

template <int HD>
__global__ void DFLASH_T8_BOUNDS
attention_tc8_kernel(const bf16 *q, int64_t ldq, int nq, const int32_t *q_positions,
                     int n_heads, int n_kv_heads, float scale, bool causal, int32_t window,
                     PagedKeys keys, float *out_part, Split *ml_part) {
    constexpr int S = 2;
    const bool early = tc_entry(keys);
    constexpr int kStride = HD + kTcPad;
    constexpr int kSteps = HD / 16;                // k16 steps of Q K^T
    constexpr int kDims = HD / kT8Warps;           // head dims per warp in O: 16 or 8
    constexpr int kDimTiles = kDims / 8;           // its n8 tiles: 2 or 1
    static_assert(kDimTiles == 1 || kDimTiles == 2, "head_dim 64 or 128");
    constexpr int kThreads = kT8Warps * 32;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    const TcStages<HD> sm{tc_smem};
    int64_t *slot_s = sm.slots(S);
    bf16 *q_s = reinterpret_cast<bf16 *>(slot_s + kTcKeys);          // [64 vectors][HD + pad]
    bf16 *p_s = q_s + kTcVectors * kStride;                          // [64 vectors][64 + 8 keys]
    float *max_s = reinterpret_cast<float *>(p_s + kTcVectors * kT8PStride);  // [64 vectors][8 warps]
    float *sum_s = max_s + kTcVectors * kT8Warps;                              // [64 vectors][8 warps]

    const int group = n_heads / n_kv_heads;
    const GroupOf gof(group);
    const int kv_head = blockIdx.x, split = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, qd = lane & 3;
    const int n_vec = nq * group;
    const int vec_base = blockIdx.z * kTcVectors;
    const int tile_vecs = min(kTcVectors, n_vec - vec_base);
    const int m_tiles = (tile_vecs + 15) / 16;  // block-uniform

    // This block's chunks: split, split + gridDim.y, ... (see grid_splits()).
    const int64_t key_end = key_count(keys);
    if (int64_t(split) * kTcKeys >= key_end) {  // no keys: nothing written, the combine stops before it
        DFLASH_PROBE(g_probe_attention, 5);
        return;
    }

    ChunkStager<HD, kThreads> cs(keys, kv_head, n_kv_heads, split, key_end, slot_s);
    const int n_chunks = cs.n_chunks;
    cs.stage_first(sm.k(0), sm.v(0), sm.kpos(0), early);
    stage_q_tile<HD, kThreads>(q_s, q, ldq, gof, kv_head, vec_base, tile_vecs, m_tiles);  // in chunk 0's group
    cp_async_commit();
    // Per thread: the vectors of rows g and g + 8 of every m tile (index mt * 2 + h). (Their positions read before
    // the wait, or their rows by GroupOf here, the kernel spilled at the 128 registers two blocks per SM allow.)
    int32_t qpos[kT8MTiles * 2];
    bool vec_ok[kT8MTiles * 2];
    float m[kT8MTiles * 2], l[kT8MTiles * 2];
#pragma unroll
    for (int i = 0; i < kT8MTiles * 2; ++i) {
        const int vl = (i >> 1) * 16 + g + 8 * (i & 1);
        vec_ok[i] = vl < tile_vecs;
        qpos[i] = vec_ok[i] ? q_positions[(vec_base + vl) / group] : 0;
        m[i] = -INFINITY;
        l[i] = 0.f;
    }
    float o[kT8MTiles][kDimTiles][4];
#pragma unroll
    for (int mt = 0; mt < kT8MTiles; ++mt)
#pragma unroll
        for (int t = 0; t < kDimTiles; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[mt][t][i] = 0.f;


    const int key0 = warp * kT8KeysPerWarp;  // this warp's keys in S
    for (int i = 0; i < n_chunks; ++i) {
        cp_async_wait<0>();  // this thread's copies of chunk i have landed
        __syncthreads();     // everyone's (and Q); chunk i - 1 consumed, its stage, P and the row buffers free
        if (i == 0) DFLASH_PROBE(g_probe_attention, 2);
        const int c = i + 1, st = c % S;
        cs.stage_keys(sm.kpos(st));
        cs.load_keys(c + 1);
        __syncthreads();  // slot_s written
        if (c < n_chunks) cs.stage_kv(sm.k(st), sm.v(st), c);
        cp_async_commit();
        if (i == 0) DFLASH_PROBE(g_probe_attention, 6);
        const int n_keys = cs.n_keys_of(i);
        const bf16 *kst = sm.k(i % S), *vst = sm.v(i % S);
        const int32_t *kpos_st = sm.kpos(i % S);

        // S = Q K^T for this warp's 8 keys, every m tile of vectors.
        float sc[kT8MTiles][4];
#pragma unroll
        for (int mt = 0; mt < kT8MTiles; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[mt][e] = 0.f;
        const bf16 *krow = kst + (key0 + g) * kStride + 2 * qd;
#pragma unroll
        for (int kk = 0; kk < kSteps; ++kk) {
            const uint32_t b0 = *reinterpret_cast<const uint32_t *>(krow + kk * 16);
            const uint32_t b1 = *reinterpret_cast<const uint32_t *>(krow + kk * 16 + 8);
#pragma unroll
            for (int mt = 0; mt < kT8MTiles; ++mt) {
                if (mt >= m_tiles) break;
                uint32_t a[4];
                ldsm_a(q_s + mt * 16 * kStride + kk * 16, kStride, lane, a);
                mma_bf16_16816(sc[mt], a[0], a[1], a[2], a[3], b0, b1);
            }
        }
        if (i == 0) DFLASH_PROBE(g_probe_attention, 7);  // (the mma issued; their results are read below)
        // Mask and scale; each vector's maximum over this warp's 8 keys (c0, c1: row g, keys key0 + 2qd (+1);
        // c2, c3: row g + 8), to max_s.
#pragma unroll
        for (int mt = 0; mt < kT8MTiles; ++mt) {
            if (mt >= m_tiles) break;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = -INFINITY;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = key0 + 2 * qd + e;
                    const int vi = mt * 2 + h;
                    const bool ok = vec_ok[vi] && j < n_keys && visible(qpos[vi], kpos_st[j], causal, window);
                    float &s = sc[mt][2 * h + e];
                    s = ok ? s * scale : -INFINITY;
                    mx = fmaxf(mx, s);
                }
                mx = quad_max(mx);
                if (qd == 0) max_s[(mt * 16 + g + 8 * h) * kT8Warps + warp] = mx;
            }
        }
        __syncthreads();  // every warp's maxima
        if (i == 0) DFLASH_PROBE(g_probe_attention, 8);
        // The chunk's maximum per vector (over the warps, exact), the new running max and the correction; P
        // (bf16) and each vector's sum over this warp's keys, to p_s and sum_s.
        float corr[kT8MTiles * 2];
#pragma unroll
        for (int mt = 0; mt < kT8MTiles; ++mt) {
            if (mt >= m_tiles) break;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int vi = mt * 2 + h, vl = mt * 16 + g + 8 * h;
                const float4 x0 = *reinterpret_cast<const float4 *>(max_s + vl * kT8Warps);
                const float4 x1 = *reinterpret_cast<const float4 *>(max_s + vl * kT8Warps + 4);
                const float cmax = fmaxf(fmaxf(fmaxf(x0.x, x0.y), fmaxf(x0.z, x0.w)),
                                         fmaxf(fmaxf(x1.x, x1.y), fmaxf(x1.z, x1.w)));
                corr[vi] = advance_max(m[vi], cmax);
                const float new_m = m[vi];
                const float s0 = sc[mt][2 * h], s1 = sc[mt][2 * h + 1];
                const float p0 = s0 == -INFINITY ? 0.f : __expf(s0 - new_m);
                const float p1 = s1 == -INFINITY ? 0.f : __expf(s1 - new_m);
                *reinterpret_cast<uint32_t *>(p_s + vl * kT8PStride + key0 + 2 * qd) = pack_bf16(p0, p1);
                float ps = p0 + p1;
                ps = quad_sum(ps);
                if (qd == 0) sum_s[vl * kT8Warps + warp] = ps;
            }
        }
        __syncthreads();  // P and the sums
        if (i == 0) DFLASH_PROBE(g_probe_attention, 9);
#pragma unroll
        for (int mt = 0; mt < kT8MTiles; ++mt) {
            if (mt >= m_tiles) break;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int vi = mt * 2 + h, vl = mt * 16 + g + 8 * h;
                if (warp == 0) {  // l is only written by warp 0
                    const float4 y0 = *reinterpret_cast<const float4 *>(sum_s + vl * kT8Warps);
                    const float4 y1 = *reinterpret_cast<const float4 *>(sum_s + vl * kT8Warps + 4);
                    l[vi] = l[vi] * corr[vi] + ((((((y0.x + y0.y) + y0.z) + y0.w) + y1.x) + y1.y) + y1.z) + y1.w;
                }
#pragma unroll
                for (int t = 0; t < kDimTiles; ++t) {
                    o[mt][t][2 * h] *= corr[vi];
                    o[mt][t][2 * h + 1] *= corr[vi];
                }
            }
        }
        // O += P V for this warp's head dims: k16 steps over the chunk's keys; V by ldmatrix.trans.
        const int d0 = warp * kDims;
#pragma unroll
        for (int ks = 0; ks < kTcKeys / 16; ++ks) {
            uint32_t b[2][2];
            const bf16 *vrow = vst + (ks * 16 + (lane & 15)) * kStride + d0;
            if constexpr (kDimTiles == 2)
                ldmatrix_x4_trans(unsigned(__cvta_generic_to_shared(vrow + (lane >> 4) * 8)), b[0][0], b[0][1], b[1][0],
                              b[1][1]);
            else
                ldmatrix_x2_trans(unsigned(__cvta_generic_to_shared(vrow)), b[0][0], b[0][1]);
#pragma unroll
            for (int mt = 0; mt < kT8MTiles; ++mt) {
                if (mt >= m_tiles) break;
                uint32_t a[4];
                ldsm_a(p_s + mt * 16 * kT8PStride + ks * 16, kT8PStride, lane, a);
#pragma unroll
                for (int t = 0; t < kDimTiles; ++t) mma_bf16_16816(o[mt][t], a[0], a[1], a[2], a[3], b[t][0], b[t][1]);
            }
        }
    }

    DFLASH_PROBE(g_probe_attention, 3);
    // This warp's head dims of every vector; warp 0 the running max and sum.
#pragma unroll
    for (int mt = 0; mt < kT8MTiles; ++mt) {
        if (mt >= m_tiles) break;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int vi = mt * 2 + h;
            if (!vec_ok[vi]) continue;
            const int v = vec_base + mt * 16 + g + 8 * h;
            const int row = gof.row(v), head = kv_head * group + gof.sub(v);
            const int64_t idx = (int64_t(split) * nq + row) * n_heads + head;
#pragma unroll
            for (int t = 0; t < kDimTiles; ++t)
                *reinterpret_cast<float2 *>(out_part + idx * HD + warp * kDims + t * 8 + 2 * qd) =
                    make_float2(o[mt][t][2 * h], o[mt][t][2 * h + 1]);
            if (warp == 0 && qd == 0) ml_part[idx] = Split{m[vi], l[vi]};
        }
    }
    DFLASH_PROBE(g_probe_attention, 4);
}

// ---------------------------------------------------------------------------------------------
// Key-quarter tensor-core path (head_dim 64 or 128; the default, DFLASH_ATTN_WARPS=16): the same blocks, chunks and splits
// as the other tensor-core kernels, but 4 warps per m16 tile of vectors (MT tiles: 4 * MT warps), warp (mt, kq)
// owning keys 16 kq .. 16 kq + 15 of every chunk for its 16 vectors with a running max, sum and O of its own. Its
// chunk is then one warp's work with no barrier inside: S = Q K^T (2 n8 tiles, K by ldmatrix), the mask, the
// maxima and sums across the quad (shuffles), P kept in registers as the A fragment of O += P V (16 keys: one
// k16 step; V by ldmatrix.trans). The eight-warp kernel shares each chunk across its warps instead: three
// barriers per chunk, the maxima and sums through shared memory, P through shared memory, about 1000 dependent
// instructions per warp (7.4 us a chunk on the H100, session 30's probe); here about 250. After the last chunk
// the four quarters of each vector are merged in quarter order through shared memory (their maxima, weights
// exp(m_q - max), O and l weighted and summed), so the split's partials are as the other kernels write them. A
// vector's sums never depend on which vectors share its tile (nor on MT): verify rows equal decode rows bit for
// bit.
//
// CK, the keys of a chunk: kTcKeys (64, 16 a warp), or 128 (DFLASH_ATTN_CHUNK=128: 32 a warp, two n8 tile pairs of S
// and two k16 steps of O += P V a chunk), so a split covers twice the keys in one pass: a 1040-key step (ctx 1024 and
// its 16 rows) is 9 chunks over 16 splits, each read in one pass, where 17 chunks of 64 leave split 0 a second pass
// (and the combine 17 splits' partials, not 9). Each CK its own sums' order (verify rows still equal decode rows).
// Measured on an H100 (session 46): no step faster at ctx 1024 (the second pass is not on the critical path: a
// ctx-1000 step, 16 chunks, is no faster either), the ctx-8192 propose 1% faster; off by default.
constexpr int kTqQuarters = 4;                      // warps per m tile: CK / 4 keys of each chunk each
constexpr int kTqWideKeys = 128;                    // DFLASH_ATTN_CHUNK=128

template <int HD>
__host__ __device__ constexpr int tq_ostride() { return HD + 8; }  // floats per merged row: conflict-free float2
template <int HD, int MT, int CK = kTcKeys>
__host__ __device__ constexpr size_t tq_loop_bytes() {
    return 2 * tc_stage_bytes<HD, CK>() + CK * sizeof(int64_t) + size_t(16 * MT) * (HD + kTcPad) * sizeof(bf16);
}
template <int HD, int MT>
__host__ __device__ constexpr size_t tq_merge_bytes() {
    return size_t(kTqQuarters) * 16 * MT * tq_ostride<HD>() * sizeof(float) +
           size_t(kTqQuarters) * 16 * MT * sizeof(float2);
}
// The merge's buffers alias the stages (after a barrier): the larger of the two.
template <int HD, int MT, int CK = kTcKeys>
__host__ __device__ constexpr size_t tq_smem_bytes() {
    return tq_loop_bytes<HD, MT, CK>() > tq_merge_bytes<HD, MT>() ? tq_loop_bytes<HD, MT, CK>()
                                                                  : tq_merge_bytes<HD, MT>();
}

template <int HD, int MT, int CK>
__global__ void __launch_bounds__(kTqQuarters * MT * 32)
attention_tcq_kernel(const bf16 *q, int64_t ldq, int nq, const int32_t *q_positions,
                     int n_heads, int n_kv_heads, float scale, bool causal, int32_t window,
                     PagedKeys keys, float *out_part, Split *ml_part) {
    constexpr int S = 2;
    constexpr int kThreads = kTqQuarters * MT * 32;
    const bool early = tc_entry(keys);
    constexpr int kStride = HD + kTcPad;
    constexpr int kSteps = HD / 16;      // k16 steps of Q K^T
    constexpr int kDimTiles = HD / 8;    // n8 tiles of O
    constexpr int kTqKeys = CK / kTqQuarters;  // a warp's keys of a chunk: 16 or 32
    constexpr int kKeyTiles = kTqKeys / 8;     // its n8 tiles of S
    constexpr int kKeySteps = kTqKeys / 16;    // its k16 steps of O += P V
    extern __shared__ __align__(16) unsigned char tc_smem[];
    const TcStages<HD, CK> sm{tc_smem};
    int64_t *slot_s = sm.slots(S);
    bf16 *q_s = reinterpret_cast<bf16 *>(slot_s + CK);  // [16 MT vectors][HD + pad]

    const int group = n_heads / n_kv_heads;
    const GroupOf gof(group);
    const int kv_head = blockIdx.x, split = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int mt = warp / kTqQuarters, kq = warp % kTqQuarters;
    const int g = lane >> 2, qd = lane & 3;
    const int n_vec = nq * group;
    const int vec_base = blockIdx.z * kTcVectors;
    const int tile_vecs = min(16 * MT, n_vec - vec_base);
    const int m_tiles = (tile_vecs + 15) / 16;
    const bool busy = mt < m_tiles;  // warp-uniform: this warp's m tile holds vectors

    const int64_t key_end = key_count(keys);
    if (int64_t(split) * CK >= key_end) {
        DFLASH_PROBE(g_probe_attention, 5);
        return;
    }
    ChunkStager<HD, kThreads, CK> cs(keys, kv_head, n_kv_heads, split, key_end, slot_s);
    const int n_chunks = cs.n_chunks;
    cs.stage_first(sm.k(0), sm.v(0), sm.kpos(0), early);
    stage_q_tile<HD, kThreads>(q_s, q, ldq, gof, kv_head, vec_base, tile_vecs, m_tiles);
    cp_async_commit();
    // Rows g and g + 8 of this warp's m tile.
    int32_t qpos[2];
    bool vec_ok[2];
    float m[2], l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int vl = mt * 16 + g + 8 * h;
        vec_ok[h] = vl < tile_vecs;
        qpos[h] = vec_ok[h] ? q_positions[gof.row(vec_base + vl)] : 0;
        m[h] = -INFINITY;
        l[h] = 0.f;
    }
    float o[kDimTiles][4];
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[t][e] = 0.f;

    const int kb = kq * kTqKeys;  // this warp's first key in a chunk
    for (int i = 0; i < n_chunks; ++i) {
        cp_async_wait<0>();
        __syncthreads();  // chunk i (and Q) landed for everyone; chunk i - 1 consumed, its stage free
        if (i == 0) DFLASH_PROBE(g_probe_attention, 2);
        const int c = i + 1, st = c % S;
        if (c < n_chunks) {  // block-uniform
            cs.stage_keys(sm.kpos(st));
            cs.load_keys(c + 1);
            __syncthreads();  // slot_s written
            cs.stage_kv(sm.k(st), sm.v(st), c);
        }
        cp_async_commit();
        if (!busy) continue;
        const int n_keys = cs.n_keys_of(i);
        const bf16 *kst = sm.k(i % S), *vst = sm.v(i % S);
        const int32_t *kpos_st = sm.kpos(i % S) + kb;

        // S = Q K^T: this warp's kTqKeys keys (n8 tiles 0 .. kKeyTiles - 1) for its 16 vectors; K fragments by
        // ldmatrix, 16 keys a call (matrices: keys 0-7 dims +0, keys 0-7 dims +8, keys 8-15 dims +0, keys 8-15
        // dims +8).
        float sc[kKeyTiles][4];
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[nt][e] = 0.f;
        const bf16 *krow = kst + (kb + (lane >> 4) * 8 + (lane & 7)) * kStride + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int kk = 0; kk < kSteps; ++kk) {
            uint32_t a[4];
            ldsm_a(q_s + mt * 16 * kStride + kk * 16, kStride, lane, a);
#pragma unroll
            for (int kg = 0; kg < kKeySteps; ++kg) {
                uint32_t b[4];
                ldmatrix_x4(unsigned(__cvta_generic_to_shared(krow + kg * 16 * kStride + kk * 16)), b[0], b[1],
                            b[2], b[3]);
                mma_bf16_16816(sc[2 * kg], a[0], a[1], a[2], a[3], b[0], b[1]);
                mma_bf16_16816(sc[2 * kg + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
        }
        // Mask and scale (sc[nt][2h + e]: row g + 8h, key kb + 8nt + 2qd + e); the maxima over the warp's keys.
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = nt * 8 + 2 * qd + e;
                const bool in = kb + j < n_keys;
                const int32_t kp = kpos_st[j];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float &s = sc[nt][2 * h + e];
                    s = in && vec_ok[h] && visible(qpos[h], kp, causal, window) ? s * scale : -INFINITY;
                    mx[h] = fmaxf(mx[h], s);
                }
            }
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            corr[h] = advance_max(m[h], quad_max(mx[h]));
            const float new_m = m[h];
            float ps = 0.f;
#pragma unroll
            for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float &s = sc[nt][2 * h + e];
                    s = s == -INFINITY ? 0.f : __expf(s - new_m);
                    ps += s;
                }
            l[h] = l[h] * corr[h] + quad_sum(ps);
        }
        // O *= corr: O is zero before the first chunk, and a factor of exactly 1 changes nothing (skipped alike
        // for every vector, so the sums stay the same whatever shares the tile).
        if (i > 0 && __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
            scale_rows(o, corr);
        }
        // O += P V, a k16 step per 16 keys: P (bf16) as the A fragment straight from S's accumulators; V pairs of
        // dim tiles by ldmatrix.trans (matrices: keys 0-7 / 8-15 of dims +0, then of dims +8).
#pragma unroll
        for (int kg = 0; kg < kKeySteps; ++kg) {
            const uint32_t a0 = pack_bf16(sc[2 * kg][0], sc[2 * kg][1]), a1 = pack_bf16(sc[2 * kg][2], sc[2 * kg][3]);
            const uint32_t a2 = pack_bf16(sc[2 * kg + 1][0], sc[2 * kg + 1][1]);
            const uint32_t a3 = pack_bf16(sc[2 * kg + 1][2], sc[2 * kg + 1][3]);
            const bf16 *vrow = vst + (kb + kg * 16 + (lane & 15)) * kStride + (lane >> 4) * 8;
#pragma unroll
            for (int tp = 0; tp < kDimTiles / 2; ++tp) {
                uint32_t b[4];
                ldmatrix_x4_trans(unsigned(__cvta_generic_to_shared(vrow + tp * 16)), b[0], b[1], b[2], b[3]);
                mma_bf16_16816(o[2 * tp], a0, a1, a2, a3, b[0], b[1]);
                mma_bf16_16816(o[2 * tp + 1], a0, a1, a2, a3, b[2], b[3]);
            }
        }
    }
    DFLASH_PROBE(g_probe_attention, 3);

    // Merge the quarters: each warp's O and (m, l) to shared memory (over the stages, once every warp is done
    // with them), then every thread weights and sums 4 dims of one vector over the quarters in order.
    constexpr int kOS = tq_ostride<HD>();
    float *o_s = reinterpret_cast<float *>(tc_smem);                            // [quarter][16 MT][kOS]
    float2 *ml_s = reinterpret_cast<float2 *>(o_s + kTqQuarters * 16 * MT * kOS);  // [16 MT][quarter]
    cp_async_wait<0>();
    __syncthreads();
    if (busy) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int vl = mt * 16 + g + 8 * h;
            float *orow = o_s + (kq * 16 * MT + vl) * kOS + 2 * qd;
#pragma unroll
            for (int t = 0; t < kDimTiles; ++t)
                *reinterpret_cast<float2 *>(orow + t * 8) = make_float2(o[t][2 * h], o[t][2 * h + 1]);
            if (qd == 0) ml_s[vl * kTqQuarters + kq] = make_float2(m[h], l[h]);
        }
    }
    __syncthreads();
    constexpr int kQuads = HD / 4;
    for (int e = threadIdx.x; e < tile_vecs * kQuads; e += kThreads) {
        const int vl = e / kQuads, d = (e % kQuads) * 4;
        float2 ml[kTqQuarters];
        float best = -INFINITY;
#pragma unroll
        for (int k = 0; k < kTqQuarters; ++k) {
            ml[k] = ml_s[vl * kTqQuarters + k];
            best = fmaxf(best, ml[k].x);
        }
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        float lsum = 0.f;
#pragma unroll
        for (int k = 0; k < kTqQuarters; ++k) {
            const float w = ml[k].x == -INFINITY ? 0.f : __expf(ml[k].x - best);
            const float4 x = *reinterpret_cast<const float4 *>(o_s + (k * 16 * MT + vl) * kOS + d);
            acc.x = fmaf(x.x, w, acc.x);
            acc.y = fmaf(x.y, w, acc.y);
            acc.z = fmaf(x.z, w, acc.z);
            acc.w = fmaf(x.w, w, acc.w);
            lsum = fmaf(ml[k].y, w, lsum);
        }
        const int v = vec_base + vl;
        const int64_t idx = (int64_t(split) * nq + gof.row(v)) * n_heads + kv_head * group + gof.sub(v);
        *reinterpret_cast<float4 *>(out_part + idx * HD + d) = acc;
        if (d == 0) ml_part[idx] = Split{best, lsum};
    }
    DFLASH_PROBE(g_probe_attention, 4);
}

constexpr int kMaxSplits = 512;  // per call (the combine's shared weights)

// One block per (row, head): merges the splits that hold keys (in split order; a split whose first
// chunk lies past the last key wrote nothing) and writes bf16. The key count (which sets the splits) is read
// before the wait where it is settled (keys.fresh_keys >= 0: the step's upload wrote it), so the split records
// are the first round trip after it. The split weights exp(m_s - max) are computed once, in parallel, into
// shared memory; then each thread sums its dims over the splits with independent loads. (Past 16 splits the
// unrolled loop's remainder issues one load at a time; batches of 16 or 32 loads, predicated or clamped to the
// last split, were no faster for a propose and up to 3% slower for verify: sessions 28-29, docs/speed-log.md.)
__global__ void attention_combine_kernel(const float *out_part, const Split *ml_part, int grid_splits,
                                         PagedKeys keys, int64_t chunk_keys, int nq, int n_heads, int hd,
                                         bf16 *out) {
    DFLASH_PROBE(g_probe_combine, 0);
    pdl_launch_dependents();
    const bool early = keys.fresh_keys >= 0;
    int64_t n_keys = early ? key_count(keys) : 0;
    pdl_wait();
    DFLASH_PROBE(g_probe_combine, 1);
    if (!early) n_keys = key_count(keys);
    __shared__ float weight_s[kMaxSplits], l_s[kMaxSplits];
    __shared__ float scratch[32];
    const int splits = int(min(int64_t(grid_splits), (n_keys + chunk_keys - 1) / chunk_keys));
    const int64_t idx = blockIdx.x;  // row * n_heads + head
    const int64_t stride = int64_t(nq) * n_heads;
    // The split records read once (one global round trip), the maximum over the block, then each split's
    // weight exp(m_s - max); the total sum in split order by every thread (from shared memory), so the
    // output dims' loads are the only other round trip. (Those loads issued with the split records, before
    // the weights are known, measured no faster on the H200: 32 splits' worth took the kernel from 34 to 128
    // registers and the whole step 1.2% slower, 16 splits' were no faster than none; session 25 runs 4-5.)
    float best = -INFINITY;
    for (int sp = threadIdx.x; sp < splits; sp += blockDim.x) {
        const Split part = ml_part[sp * stride + idx];
        weight_s[sp] = part.m;
        l_s[sp] = part.l;
        best = fmaxf(best, part.m);
    }
    best = block_max(best, scratch);  // its barriers also publish weight_s and l_s
    DFLASH_PROBE(g_probe_combine, 2);
    for (int sp = threadIdx.x; sp < splits; sp += blockDim.x) {
        const float m = weight_s[sp];
        weight_s[sp] = m == -INFINITY ? 0.f : __expf(m - best);
    }
    __syncthreads();
    float total = 0.f;
    for (int sp = 0; sp < splits; ++sp) total = fmaf(l_s[sp], weight_s[sp], total);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
#pragma unroll 16
        for (int sp = 0; sp < splits; ++sp)
            acc = fmaf(out_part[(sp * stride + idx) * hd + d], weight_s[sp], acc);
        out[idx * hd + d] = to_bf16(total > 0.f ? acc / total : 0.f);
    }
    DFLASH_PROBE(g_probe_combine, 3);
}

struct Plan {
    int rows_per_tile, q_tiles, splits;
    int64_t chunk_keys;  // keys per chunk: kKeysPerChunk or kTcKeys
};

// Keys are read in chunks (32 keys, 64 on the tensor-core path) at fixed key indices, and chunk c
// belongs to split c % splits: split s reads chunks s, s + splits, s + 2 splits, ... with one online
// softmax, and the combine merges the splits in split order. `splits` depends only on the ring's
// capacity, the kv head count and the widest call that must agree with a decode step
// (keys.uniform_rows: verify blocks and decode steps; wider calls, prefill chunks, use their own
// row count), never on how many keys a call has. A query row then sums the same chunks in the same
// order whether it is verified among 16 rows or decoded alone (its masked keys, whole chunks of
// them included, change neither its running max nor its sums: exact no-ops), so verify logits
// equal decode logits bit for bit (DESIGN §5) at any context length.
//
// splits x kv heads x query tiles fill the GPU about twice (264 blocks: 132 SMs) once the context
// has that many chunks (the key-quarter kernel, whose 4-tile blocks take a whole SM: once, one wave; with 17
// splits of a 1040-key verify, 4 of its 136 blocks ran in a second wave and the kernel was no faster than the
// eight-warp one, with 16 it is 1.9% faster: session 31); a short context keeps its chunks in separate splits (a 1024-key context is
// 16 chunks of 64 keys: 16 splits per kv head, whatever the capacity), a long one gives each split
// several. The grid, the partials (splits x rows x heads) and the combine are bounded by that fill,
// not by the ring: with the key count in device memory (keys.num_keys_device, graphs) a split
// whose first chunk lies past the last key returns at once and the combine reads only the splits
// up to the last key, so one recorded graph serves every length.
//
// Which tensor-core kernel (head_dim 64 or 128) is asked for: DFLASH_ATTN_WARPS=16 (or unset) the key-quarter one
// (attention_tcq_kernel: up to 16 warps, 4 per m16 tile of vectors; session 31: verify 1.6%, proposes 1.6-2.8%
// faster than the eight-warp one on the H100), 8 the eight-warp one (attention_tc8_kernel), 4 the four-warp one.
// Read once. tc_kernel() (below) is the one that runs: the one asked for where its shared memory fits.
enum class TcKernel { kFour, kEight, kQuarter };
TcKernel tc_kernel();
TcKernel requested_tc_kernel() {
    static const TcKernel k = [] {
        const char *v = std::getenv("DFLASH_ATTN_WARPS");
        if (!v || !*v || std::string(v) == "16") return TcKernel::kQuarter;
        if (std::string(v) == "8") return TcKernel::kEight;
        if (std::string(v) == "4") return TcKernel::kFour;
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "DFLASH_ATTN_WARPS=", v, " (4, 8 or 16)");
    }();
    return k;
}

// DFLASH_ATTN_CHUNK=64|128 (read once): the key-quarter kernel's keys per chunk (attention_tcq_kernel's CK; the
// other kernels keep 64). 0: unset (64).
int tq_chunk_keys() {
    static const int keys = [] {
        const char *v = std::getenv("DFLASH_ATTN_CHUNK");
        if (!v || !*v || std::string(v) == "64") return kTcKeys;
        if (std::string(v) == "128") return kTqWideKeys;
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "DFLASH_ATTN_CHUNK=", v, " (64 or 128)");
    }();
    return keys;
}

// DFLASH_ATTN_FILL=N (read once) aims at N blocks instead of 264 (or one wave, below): a test forces few splits,
// so each split reads many chunks at short contexts. 0: unset.
int64_t fill_blocks() {
    static const EnvInt setting = env_int("DFLASH_ATTN_FILL", 0, 1, 1 << 20);
    return env_value(setting, "DFLASH_ATTN_FILL", "is not a block count (1 to 1048576)");
}

// The SM count of the device current at the first call (a process's calls all split alike).
int64_t sm_count() {
    static const int64_t n = [] {
        int device = 0, v = 0;
        DFLASH_CUDA_CHECK(cudaGetDevice(&device));
        DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
        return int64_t(std::max(v, 1));
    }();
    return n;
}

// one_wave (the key-quarter kernel, whose 4-tile blocks take a whole SM): at most one block per SM, rounded
// down to whole splits (a 1040-key verify on 132 SMs: 16 splits of 8 kv heads, not 17 with 4 blocks in a second
// wave), else about 264 blocks.
int grid_splits(int64_t capacity, int64_t n_kv_heads, int64_t chunk_keys, int64_t q_tiles, bool one_wave) {
    const int64_t blocks_per_split = std::max<int64_t>(1, n_kv_heads * q_tiles);
    const int64_t fill = fill_blocks();
    const int64_t want = fill > 0       ? (fill + blocks_per_split - 1) / blocks_per_split
                         : one_wave     ? std::max<int64_t>(1, sm_count() / blocks_per_split)
                                        : (264 + blocks_per_split - 1) / blocks_per_split;
    const int64_t chunks = std::max<int64_t>(1, (capacity + chunk_keys - 1) / chunk_keys);
    return int(std::min({want, chunks, int64_t(kMaxSplits)}));
}

int64_t capacity(const PagedKeys &keys) { return std::max<int64_t>(keys.ring_slots, keys.num_keys); }

// The row count that sets the splits: keys.uniform_rows for calls up to that wide, else nq.
int64_t split_rows(int64_t nq, const PagedKeys &keys) {
    return keys.uniform_rows > 0 && nq <= keys.uniform_rows ? keys.uniform_rows : nq;
}

// The tensor-core path: 64 query vectors per block, chunks of 64 keys.
bool use_tc(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

// A query tile: rows_per_tile query rows (their vectors, at most kMaxQueryVectors) on the split
// kernel, kTcVectors query vectors on the tensor-core kernel.
Plan plan_for(int64_t nq, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, const PagedKeys &keys) {
    const int64_t group = n_heads / n_kv_heads;
    const bool tc = use_tc(head_dim);
    Plan p;
    p.rows_per_tile = tc ? 0 : int(std::max<int64_t>(1, kMaxQueryVectors / group));  // tc: unused
    const bool quarter = tc && tc_kernel() == TcKernel::kQuarter;
    p.chunk_keys = !tc ? kKeysPerChunk : quarter ? tq_chunk_keys() : kTcKeys;
    auto tiles = [&](int64_t rows) {
        return tc ? (rows * group + kTcVectors - 1) / kTcVectors : (rows + p.rows_per_tile - 1) / p.rows_per_tile;
    };
    p.q_tiles = int(tiles(nq));
    p.splits = grid_splits(capacity(keys), n_kv_heads, p.chunk_keys, tiles(split_rows(nq, keys)), quarter);
    return p;
}

// The opt-in for more than 48 KB of dynamic shared memory, for every tensor-core instantiation that fits
// the device (3 stages of head_dim 128 take 104 KB: sm_86 and sm_89 allow 99); once per process, for the
// device current then. Returns whether 3 stages of head_dim `hd` fit.
bool allow_tc_smem(int64_t hd) {
    static const int fits3 = [] {  // bit 0: head_dim 64, bit 1: head_dim 128
        int device = 0, optin = 0;
        DFLASH_CUDA_CHECK(cudaGetDevice(&device));
        DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
        auto allow = [&](auto kernel, size_t bytes) {
            if (bytes > size_t(optin)) return false;
            DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
            return true;
        };
        if (!allow(attention_tc_kernel<128, 2>, tc_smem_bytes<128, 2>()) ||
            !allow(attention_tc_kernel<64, 2>, tc_smem_bytes<64, 2>()))
            fail(DFLASH_STATUS_NOT_SUPPORTED, "cuda attention: ", tc_smem_bytes<128, 2>(),
                 " bytes of shared memory per block needed, the device allows ", optin);
        return (allow(attention_tc_kernel<64, 3>, tc_smem_bytes<64, 3>()) ? 1 : 0) |
               (allow(attention_tc_kernel<128, 3>, tc_smem_bytes<128, 3>()) ? 2 : 0);
    }();
    return fits3 & (hd == 128 ? 2 : 1);
}

// The shared-memory opt-ins of the key-quarter kernel's instantiations of one chunk size (CK).
template <int CK>
void allow_tcq_smem_of() {
    auto allow = [](auto kernel, size_t bytes) {
        DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    };
    allow(attention_tcq_kernel<128, 1, CK>, tq_smem_bytes<128, 1, CK>());
    allow(attention_tcq_kernel<128, 2, CK>, tq_smem_bytes<128, 2, CK>());
    allow(attention_tcq_kernel<128, 4, CK>, tq_smem_bytes<128, 4, CK>());
    allow(attention_tcq_kernel<64, 1, CK>, tq_smem_bytes<64, 1, CK>());
    allow(attention_tcq_kernel<64, 2, CK>, tq_smem_bytes<64, 2, CK>());
    allow(attention_tcq_kernel<64, 4, CK>, tq_smem_bytes<64, 4, CK>());
}

// The key-quarter kernel's shared-memory opt-ins for the process's chunk size (tq_chunk_keys), once per process (for
// the device current then). Returns whether its largest instantiation fits.
bool allow_tcq_smem() {
    static const bool fits = [] {
        int device = 0, optin = 0;
        DFLASH_CUDA_CHECK(cudaGetDevice(&device));
        DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
        const bool wide = tq_chunk_keys() == kTqWideKeys;
        if ((wide ? tq_smem_bytes<128, 4, kTqWideKeys>() : tq_smem_bytes<128, 4>()) > size_t(optin)) return false;
        wide ? allow_tcq_smem_of<kTqWideKeys>() : allow_tcq_smem_of<kTcKeys>();
        return true;
    }();
    return fits;
}

// Its shared-memory opt-in, once per process (for the device current then). Returns whether it fits (99 KB,
// sm_86 and sm_89's limit, does not: they take the four-warp kernel, for every call alike).
bool allow_tc8_smem() {
    static const bool fits = [] {
        int device = 0, optin = 0;
        DFLASH_CUDA_CHECK(cudaGetDevice(&device));
        DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
        if (t8_smem_bytes<128>() > size_t(optin)) return false;
        DFLASH_CUDA_CHECK(cudaFuncSetAttribute(attention_tc8_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(t8_smem_bytes<128>())));
        DFLASH_CUDA_CHECK(cudaFuncSetAttribute(attention_tc8_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(t8_smem_bytes<64>())));
        return true;
    }();
    return fits;
}

// The tensor-core kernel every call of this process runs (their sums differ in order, so it is chosen once, for
// the device current then): the one asked for (requested_tc_kernel), else the next whose shared memory fits
// (key-quarter 138 KB, eight-warp 101 KB; sm_86 and sm_89 allow 99: the four-warp kernel).
TcKernel tc_kernel() {
    static const TcKernel k = [] {
        const TcKernel want = requested_tc_kernel();
        if (want == TcKernel::kQuarter && allow_tcq_smem()) return TcKernel::kQuarter;
        if (want != TcKernel::kFour && allow_tc8_smem()) return TcKernel::kEight;
        return TcKernel::kFour;
    }();
    return k;
}

size_t smem_bytes(int64_t hd) {
    return kMaxQueryVectors * hd * sizeof(float) + 2 * kKeysPerChunk * (hd + kPad) * sizeof(bf16) +
           kKeysPerChunk * sizeof(int32_t);
}

}  // namespace

size_t attention_scratch_bytes(int64_t nq, int64_t n_heads, int64_t head_dim, int64_t n_kv_heads,
                               const PagedKeys &keys) {
    // The splits do not depend on the key count: a context that grows never reallocates the
    // scratch (which would make every recorded graph stale).
    const Plan p = plan_for(nq, n_heads, n_kv_heads, head_dim, keys);
    const size_t parts = size_t(p.splits) * size_t(nq) * size_t(n_heads);
    return parts * size_t(head_dim) * sizeof(float) + parts * sizeof(Split) + 16;
}

void attention(const bf16 *q, int64_t ldq, int64_t nq, const int32_t *q_positions, int64_t n_heads,
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
    if (ldq < n_heads * head_dim || ldq % 2)
        fail(DFLASH_STATUS_INTERNAL, "cuda attention: q row stride ", ldq, " (rows of ", n_heads * head_dim,
             "; even)");
    const bool tc = use_tc(head_dim);
    const Plan p = plan_for(nq, n_heads, n_kv_heads, head_dim, keys);  // splits <= kMaxSplits (grid_splits)
    const size_t parts = size_t(p.splits) * size_t(nq) * size_t(n_heads);
    float *out_part = static_cast<float *>(scratch);
    // Split records after the partial outputs, 8-byte aligned.
    auto *ml_part = reinterpret_cast<Split *>(
        (reinterpret_cast<uintptr_t>(out_part + parts * size_t(head_dim)) + 7) & ~uintptr_t(7));
    const dim3 grid(unsigned(n_kv_heads), unsigned(p.splits), unsigned(p.q_tiles));
    // The tensor-core kernels' launch (the same arguments; kernel, threads and shared memory differ).
    auto go = [&](auto kernel, int threads, size_t smem) {
        launch(kernel, grid, threads, smem, s, q, ldq, int(nq), q_positions, int(n_heads), int(n_kv_heads), scale,
               mask.causal, mask.window, keys, out_part, ml_part);
    };
    if (tc && tc_kernel() == TcKernel::kQuarter) {
        // m16 tiles per block: the vectors of a one-tile call (a decode step's 4 take one warp per quarter), else 4.
        const int64_t n_vec = nq * (n_heads / n_kv_heads);
        const int mt = p.q_tiles > 1 ? 4 : int((n_vec + 15) / 16);
        // The instantiation for head_dim HD and chunks of CK keys (integral constants).
        auto pick = [&](auto hd, auto ck) {
            constexpr int HD = decltype(hd)::value, CK = decltype(ck)::value;
            if (mt <= 1) go(attention_tcq_kernel<HD, 1, CK>, kTqQuarters * 32, tq_smem_bytes<HD, 1, CK>());
            else if (mt == 2) go(attention_tcq_kernel<HD, 2, CK>, 2 * kTqQuarters * 32, tq_smem_bytes<HD, 2, CK>());
            else go(attention_tcq_kernel<HD, 4, CK>, 4 * kTqQuarters * 32, tq_smem_bytes<HD, 4, CK>());
        };
        using HD128 = std::integral_constant<int, 128>;
        using HD64 = std::integral_constant<int, 64>;
        using Wide = std::integral_constant<int, kTqWideKeys>;
        using Narrow = std::integral_constant<int, kTcKeys>;
        const bool wide = p.chunk_keys == kTqWideKeys;
        if (head_dim == 128 && wide) pick(HD128{}, Wide{});
        else if (head_dim == 128) pick(HD128{}, Narrow{});
        else if (wide) pick(HD64{}, Wide{});
        else pick(HD64{}, Narrow{});
    } else if (tc && tc_kernel() == TcKernel::kEight) {
        if (head_dim == 128)
            go(attention_tc8_kernel<128>, kT8Warps * 32, t8_smem_bytes<128>());
        else
            go(attention_tc8_kernel<64>, kT8Warps * 32, t8_smem_bytes<64>());
    } else if (tc) {
        // 3 stages where a split may read 3 chunks or more (by the ring's capacity, never the key count),
        // else 2: the stage count changes when bytes arrive, never the sums.
        const int64_t chunks = (capacity(keys) + kTcKeys - 1) / kTcKeys;
        const bool fits3 = allow_tc_smem(head_dim);  // sets the shared-memory opt-ins (first call)
        const bool deep = (chunks + p.splits - 1) / p.splits >= 3 && fits3;
        constexpr int kThreads = kTcWarps * 32;
        if (head_dim == 128)
            deep ? go(attention_tc_kernel<128, 3>, kThreads, tc_smem_bytes<128, 3>())
                 : go(attention_tc_kernel<128, 2>, kThreads, tc_smem_bytes<128, 2>());
        else
            deep ? go(attention_tc_kernel<64, 3>, kThreads, tc_smem_bytes<64, 3>())
                 : go(attention_tc_kernel<64, 2>, kThreads, tc_smem_bytes<64, 2>());
    } else {
        const size_t smem = smem_bytes(head_dim);
        static bool raised = false;  // the opt-in for more than 48 KB of dynamic shared memory
        if (!raised) {
            DFLASH_CUDA_CHECK(cudaFuncSetAttribute(attention_split_kernel,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   int(smem_bytes(kMaxHeadDim))));
            raised = true;
        }
        launch(attention_split_kernel, grid, kWarps * 32, smem, s,
            q, ldq, int(nq), q_positions, int(n_heads), int(n_kv_heads), int(head_dim), p.rows_per_tile,
            scale, mask.causal, mask.window, keys, out_part, ml_part);
    }
    launch(attention_combine_kernel, unsigned(nq * n_heads), 128, 0, s,
        out_part, ml_part, p.splits, keys, p.chunk_keys, int(nq), int(n_heads), int(head_dim), out);
}

#ifdef DFLASH_PHASE_PROBE
// gemm_chain_bench --probe: table 0 attention's, 1 the combine's; out nullptr zeroes it, else it is read into out.
// Returns the stamps per row.
int probe_table_attention(int which, std::vector<unsigned long long> *out) {
    return which == 0 ? probe_table_io(g_probe_attention, out) : probe_table_io(g_probe_combine, out);
}
#endif

}  // namespace cuda
}  // namespace dflash
