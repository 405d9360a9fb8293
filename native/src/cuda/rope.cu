// rope.cu: in-place rotate-half RoPE. The angle pos * inv_freq is one fp32 multiply, as in
// transformers; cos/sin use the accurate cosf/sinf (positions reach 1e5+, far beyond the
// fast intrinsics' range reduction).
#include "ops.cuh"

namespace dflash {
namespace cuda {
namespace {

// x: [rows, ld] holding [heads, head_dim]; positions: [rows]; inv_freq: [head_dim / 2]
__global__ void rope_kernel(bf16 *x, int64_t heads, int64_t head_dim, int64_t ld,
                            const int32_t *positions, const float *inv_freq, float attention_factor) {
    const int64_t row = blockIdx.x, half = head_dim / 2;
    const float pos = float(positions[row]);
    for (int64_t i = threadIdx.x; i < heads * half; i += blockDim.x) {
        const int64_t h = i / half, j = i % half;
        const float angle = pos * inv_freq[j];
        const float c = cosf(angle) * attention_factor, s = sinf(angle) * attention_factor;
        bf16 *v = x + row * ld + h * head_dim;
        const float a = to_float(v[j]), b = to_float(v[j + half]);
        v[j] = to_bf16(a * c - b * s);
        v[j + half] = to_bf16(b * c + a * s);
    }
}

}  // namespace

void rope(bf16 *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
          const int32_t *positions, const float *inv_freq, float attention_factor, cudaStream_t s) {
    if (rows == 0) return;
    rope_kernel<<<unsigned(rows), 128, 0, s>>>(x, heads, head_dim, ld, positions, inv_freq,
                                               attention_factor);
    DFLASH_CUDA_LAUNCHED();
}

}  // namespace cuda
}  // namespace dflash
