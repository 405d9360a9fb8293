// rope.cu: in-place rotate-half RoPE. The angle pos * inv_freq is one fp32 multiply, as in
// transformers; cos/sin use the accurate cosf/sinf (positions reach 1e5+, far beyond the
// fast intrinsics' range reduction).
#include <algorithm>

#include "ops.cuh"

namespace dflash {
namespace cuda {
namespace {

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
// Norm (fp32 statistics, result rounded to bf16 as rms_norm stores it), then the rotation.
constexpr int kMaxPairsPerLane = 4;  // head_dim <= 256
constexpr int kWarpsPerBlock = 4;

__global__ void head_norm_rope_kernel(bf16 *x, int64_t rows, int heads, int head_dim, int64_t ld,
                                      const bf16 *w, float eps, const int32_t *positions,
                                      const float *inv_freq, float attention_factor) {
    pdl_prologue();
    const int lane = threadIdx.x & 31;
    const int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
    if (item >= rows * heads) return;
    const int64_t row = item / heads;
    const int h = int(item % heads), half = head_dim / 2;
    bf16 *v = x + row * ld + int64_t(h) * head_dim;
    float a[kMaxPairsPerLane], b[kMaxPairsPerLane];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxPairsPerLane; ++i) {
        const int j = lane + 32 * i;
        a[i] = j < half ? to_float(v[j]) : 0.f;
        b[i] = j < half ? to_float(v[j + half]) : 0.f;
        ss += a[i] * a[i] + b[i] * b[i];
    }
    if (w) {
        const float inv = rsqrtf(warp_sum(ss) / float(head_dim) + eps);
#pragma unroll
        for (int i = 0; i < kMaxPairsPerLane; ++i) {
            const int j = lane + 32 * i;
            if (j < half) {
                a[i] = to_float(to_bf16(to_float(w[j]) * (a[i] * inv)));
                b[i] = to_float(to_bf16(to_float(w[j + half]) * (b[i] * inv)));
            }
        }
    }
    const float pos = float(positions[row]);
#pragma unroll
    for (int i = 0; i < kMaxPairsPerLane; ++i) {
        const int j = lane + 32 * i;
        if (j >= half) break;
        float sn, cs;
        sincosf(pos * inv_freq[j], &sn, &cs);
        cs *= attention_factor;
        sn *= attention_factor;
        v[j] = to_bf16(a[i] * cs - b[i] * sn);
        v[j + half] = to_bf16(b[i] * cs + a[i] * sn);
    }
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

}  // namespace cuda
}  // namespace dflash
