// norm.cu: RMSNorm (HF form x * w / rms(x)) over `groups` vectors of `dim` per row; the per-head
// q_norm / k_norm are the same op with groups = heads. One block per vector, fp32 statistics.
// y may alias x: every thread reads its elements before writing them.
#include "ops.cuh"

namespace dflash {
namespace cuda {
namespace {

constexpr int kThreads = 128;

// x: [rows, ld_x] holding [groups, dim]; w: [dim]; y: [rows, ld_y]
__global__ void rms_norm_kernel(const bf16 *x, int64_t groups, int64_t dim, int64_t ld_x,
                                const bf16 *w, float eps, bf16 *y, int64_t ld_y) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x / groups, g = blockIdx.x % groups;
    const bf16 *in = x + row * ld_x + g * dim;
    bf16 *out = y + row * ld_y + g * dim;
    float ss = 0.f;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
        const float v = to_float(in[c]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / float(dim) + eps);
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x)
        out[c] = to_bf16(to_float(w[c]) * (to_float(in[c]) * inv));
}

}  // namespace

void rms_norm(const bf16 *x, int64_t rows, int64_t groups, int64_t dim, int64_t ld_x,
              const bf16 *w, float eps, bf16 *y, int64_t ld_y, cudaStream_t s) {
    if (rows * groups == 0) return;
    if (rows * groups > INT32_MAX) fail(DFLASH_STATUS_INTERNAL, "rms_norm: too many rows");
    rms_norm_kernel<<<unsigned(rows * groups), kThreads, 0, s>>>(x, groups, dim, ld_x, w, eps, y,
                                                                 ld_y);
    DFLASH_CUDA_LAUNCHED();
}

}  // namespace cuda
}  // namespace dflash
