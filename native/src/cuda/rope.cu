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

}  // namespace

void rope(bf16 *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
          const int32_t *positions, const float *inv_freq, float attention_factor, cudaStream_t s) {
    if (rows == 0) return;
    if (rows > INT32_MAX || heads > INT32_MAX || head_dim > 4096)
        fail(DFLASH_STATUS_INTERNAL, "rope: shape out of range");
    const int half = int(head_dim / 2);
    const dim3 block(unsigned(std::min(half, 128)), kHeadsPerBlock);
    const dim3 grid(unsigned(rows), unsigned((heads + kHeadsPerBlock - 1) / kHeadsPerBlock));
    rope_kernel<<<grid, block, 0, s>>>(x, int(heads), int(head_dim), ld, positions, inv_freq,
                                       attention_factor);
    DFLASH_CUDA_LAUNCHED();
}

}  // namespace cuda
}  // namespace dflash
