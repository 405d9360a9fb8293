// rope.cu: in-place rotate-half RoPE. The angle pos * inv_freq is one fp32 multiply, as in
// transformers; cos/sin use the accurate cosf/sinf (positions reach 1e5+, far beyond the
// fast intrinsics' range reduction).
#include <algorithm>
#include <vector>

#include "ops.cuh"
#include "rope_head.cuh"

namespace dflash {
namespace cuda {
namespace {

#ifdef DFLASH_PHASE_PROBE
DFLASH_PROBE_TABLE(g_probe_rope);  // qkv_norm_rope_write_kernel: 0 entry, 1 after the wait (the q/k/v GEMM done)
#endif

constexpr int kHeadsPerBlock = 4;

// x: [rows, ld] holding [heads, head_dim]; positions: [rows]; inv_freq: [head_dim / 2].
// grid (rows, ceil(heads / kHeadsPerBlock)); thread (j, hl) rotates pair j of head
// blockIdx.y * kHeadsPerBlock + hl, for j striding over half.
__global__ void rope_kernel(bf16 *x, int heads, int head_dim, int64_t ld, const int32_t *positions,
                            const float *inv_freq, float attention_factor) {
    pdl_prologue();
    const int half = head_dim / 2;
    const int h = blockIdx.y * kHeadsPerBlock + threadIdx.y;
    if (h >= heads) return;
    const float pos = float(positions[blockIdx.x]);
    bf16 *v = x + int64_t(blockIdx.x) * ld + int64_t(h) * head_dim;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const float angle = pos * inv_freq[j];
        float s, c;
        sincosf(angle, &s, &c);
        c *= attention_factor;
        s *= attention_factor;
        const float a = to_float(v[j]), b = to_float(v[j + half]);
        v[j] = to_bf16(a * c - b * s);
        v[j + half] = to_bf16(b * c + a * s);
    }
}

// One warp per (row, head): lane owns rotation pairs j = lane, lane + 32, ... (j and j + half).
// Norm (fp32 statistics, result rounded to bf16 as rms_norm stores it), then the rotation (rope_head.cuh).
constexpr int kWarpsPerBlock = 4;

__global__ void head_norm_rope_kernel(bf16 *x, int64_t rows, int heads, int head_dim, int64_t ld,
                                      const bf16 *w, float eps, const int32_t *positions,
                                      const float *inv_freq, float attention_factor) {
    pdl_launch_dependents();
    const int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const bool ok = item < rows * heads;
    const int64_t row = ok ? item / heads : 0;
    LaneRope r{};
    if (ok) r = lane_rope(head_dim, w, float(positions[row]), inv_freq, attention_factor, lane);
    pdl_wait();
    if (!ok) return;
    norm_rope_head(x + row * ld + (item % heads) * head_dim, head_dim, w != nullptr, eps, r, nullptr, lane);
}

// One warp per (row, head), heads of a row counted q, then k, then v: q heads normed and rotated
// in place, k heads likewise and copied to their cache slot, v heads copied to theirs (a row whose slot is
// negative, a padding row, is normed and rotated but not copied).
__global__ void qkv_norm_rope_write_kernel(bf16 *q, int64_t ldq, bf16 *kv, int64_t ldkv, int64_t rows, int heads,
                                           int kv_heads, int head_dim, const bf16 *q_norm, const bf16 *k_norm,
                                           float eps,
                                           const int32_t *positions, const float *inv_freq,
                                           float attention_factor, const int32_t *slots, bf16 *k_cache,
                                           bf16 *v_cache) {
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, per_row = heads + 2 * kv_heads;
    const int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
    const bool ok = item < rows * per_row;
    const int64_t row = ok ? item / per_row : 0;
    const int h = ok ? int(item % per_row) : 0;
    const bf16 *w = h < heads ? q_norm : k_norm;
    LaneRope r{};
    int64_t slot = 0;
    if (ok && h < heads + kv_heads) r = lane_rope(head_dim, w, float(positions[row]), inv_freq, attention_factor, lane);
    if (ok && h >= heads) slot = slots[row];  // the step's upload too
    DFLASH_PROBE(g_probe_rope, 0);
    pdl_wait();
    DFLASH_PROBE(g_probe_rope, 1);
    if (!ok) return;
    if (h < heads) {
        norm_rope_head(q + row * ldq + int64_t(h) * head_dim, head_dim, q_norm != nullptr, eps, r, nullptr, lane);
        return;
    }
    bf16 *src = kv + row * ldkv + int64_t(h - heads) * head_dim;  // k heads, then v heads
    const int64_t kv_width = int64_t(kv_heads) * head_dim;
    if (h < heads + kv_heads) {
        norm_rope_head(src, head_dim, k_norm != nullptr, eps, r,
                       slot < 0 ? nullptr : k_cache + slot * kv_width + int64_t(h - heads) * head_dim, lane);
        return;
    }
    if (slot < 0) return;
    copy_head(src, v_cache + slot * kv_width + int64_t(h - heads - kv_heads) * head_dim, head_dim, lane);
}

// kv_norm_rope_write_kernel's k and v part for several layers of the same rows: one warp per (row, layer,
// head), a row's items counted layer by layer (k heads, then v heads); layer l's heads at column l * layer_ld.
__global__ void kv_norm_rope_write_layers_kernel(bf16 *kv, int64_t ldkv, int64_t layer_ld, int layers, int64_t rows,
                                                 int kv_heads, int head_dim, RopeLayers per_layer, float eps,
                                                 const int32_t *positions, const float *inv_freq,
                                                 float attention_factor, const int32_t *slots) {
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, per_layer_items = 2 * kv_heads, per_row = layers * per_layer_items;
    const int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
    const bool ok = item < rows * per_row;
    const int64_t row = ok ? item / per_row : 0;
    const int in_row = ok ? int(item % per_row) : 0;
    const int l = in_row / per_layer_items, h = in_row % per_layer_items;
    const bf16 *w = per_layer.k_norm[l];
    LaneRope r{};
    int64_t slot = 0;
    if (ok && h < kv_heads) r = lane_rope(head_dim, w, float(positions[row]), inv_freq, attention_factor, lane);
    if (ok) slot = slots[row];  // the step's upload too
    pdl_wait();
    if (!ok) return;
    bf16 *src = kv + row * ldkv + l * layer_ld + int64_t(h) * head_dim;  // k heads, then v heads
    const int64_t kv_width = int64_t(kv_heads) * head_dim;
    if (h < kv_heads) {
        norm_rope_head(src, head_dim, w != nullptr, eps, r,
                       slot < 0 ? nullptr : per_layer.k_cache[l] + slot * kv_width + int64_t(h) * head_dim, lane);
        return;
    }
    if (slot < 0) return;
    copy_head(src, per_layer.v_cache[l] + slot * kv_width + int64_t(h - kv_heads) * head_dim, head_dim, lane);
}

}  // namespace

void head_norm_rope(bf16 *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
                    const bf16 *w, float eps, const int32_t *positions, const float *inv_freq,
                    float attention_factor, cudaStream_t s) {
    if (rows * heads == 0) return;
    if (head_dim % 2 || head_dim > 64 * kMaxPairsPerLane || heads > INT32_MAX) {
        if (w) rms_norm(x, rows, heads, head_dim, ld, w, eps, x, ld, s);
        rope(x, rows, heads, head_dim, ld, positions, inv_freq, attention_factor, s);
        return;
    }
    const int64_t items = rows * heads;
    launch(head_norm_rope_kernel, unsigned((items + kWarpsPerBlock - 1) / kWarpsPerBlock),
           kWarpsPerBlock * 32, 0, s, x, rows, int(heads), int(head_dim), ld, w, eps, positions,
           inv_freq, attention_factor);
}

bool qkv_norm_rope_write_fused(int64_t head_dim) { return head_dim % 2 == 0 && head_dim <= 64 * kMaxPairsPerLane; }

void qkv_norm_rope_write(bf16 *q, int64_t ldq, bf16 *kv, int64_t ldkv, int64_t rows, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, const bf16 *q_norm, const bf16 *k_norm, float eps,
                         const int32_t *positions, const float *inv_freq, float attention_factor,
                         const int32_t *slots, bf16 *k_cache, bf16 *v_cache, cudaStream_t s) {
    const int64_t items = rows * (heads + 2 * kv_heads);
    if (items == 0) return;
    if (!qkv_norm_rope_write_fused(head_dim) || heads + 2 * kv_heads > INT32_MAX)
        fail(DFLASH_STATUS_INTERNAL, "qkv_norm_rope_write: head_dim ", head_dim, " is not fused");
    launch(qkv_norm_rope_write_kernel, unsigned((items + kWarpsPerBlock - 1) / kWarpsPerBlock),
           kWarpsPerBlock * 32, 0, s, q, ldq, kv, ldkv, rows, int(heads), int(kv_heads), int(head_dim), q_norm,
           k_norm, eps, positions, inv_freq, attention_factor, slots, k_cache, v_cache);
}

void qkv_norm_rope_write(bf16 *y, int64_t ldy, int64_t rows, const RopeTail &t, cudaStream_t s) {
    qkv_norm_rope_write(y, ldy, y + int64_t(t.heads) * t.head_dim, ldy, rows, t.heads, t.kv_heads, t.head_dim,
                        t.q_norm, t.k_norm, t.eps, t.positions, t.inv_freq, t.attention_factor, t.slots, t.k_cache,
                        t.v_cache, s);
}

void kv_norm_rope_write_layers(bf16 *kv, int64_t ldkv, int64_t layer_ld, int layers, int64_t rows, int64_t kv_heads,
                               int64_t head_dim, const RopeLayers &per_layer, float eps, const int32_t *positions,
                               const float *inv_freq, float attention_factor, const int32_t *slots, cudaStream_t s) {
    const int64_t items = rows * layers * 2 * kv_heads;
    if (items == 0) return;
    if (!qkv_norm_rope_write_fused(head_dim) || layers < 1 || layers > kMaxRopeLayers ||
        layers * 2 * kv_heads > INT32_MAX)
        fail(DFLASH_STATUS_INTERNAL, "kv_norm_rope_write_layers: head_dim ", head_dim, ", ", layers,
             " layers: not fused");
    launch(kv_norm_rope_write_layers_kernel, unsigned((items + kWarpsPerBlock - 1) / kWarpsPerBlock),
           kWarpsPerBlock * 32, 0, s, kv, ldkv, layer_ld, layers, rows, int(kv_heads), int(head_dim), per_layer, eps,
           positions, inv_freq, attention_factor, slots);
}

void rope(bf16 *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
          const int32_t *positions, const float *inv_freq, float attention_factor, cudaStream_t s) {
    if (rows == 0) return;
    if (rows > INT32_MAX || heads > INT32_MAX || head_dim > 4096)
        fail(DFLASH_STATUS_INTERNAL, "rope: shape out of range");
    const int half = int(head_dim / 2);
    const dim3 block(unsigned(std::min(half, 128)), kHeadsPerBlock);
    const dim3 grid(unsigned(rows), unsigned((heads + kHeadsPerBlock - 1) / kHeadsPerBlock));
    launch(rope_kernel, grid, block, 0, s, x, int(heads), int(head_dim), ld, positions, inv_freq,
           attention_factor);
}

#ifdef DFLASH_PHASE_PROBE
// gemm_chain_bench --probe: out nullptr zeroes the table, else it is read into out. Returns the stamps per row.
int probe_table_rope(std::vector<unsigned long long> *out) { return probe_table_io(g_probe_rope, out); }
#endif

}  // namespace cuda
}  // namespace dflash
