// gemv_argmax.cu: the lm_head's fused argmax partials (logits_argmax): gemm_stream_kernel<KS, Argmax, ...>,
// gemm_mma_kernel<KS, Argmax>.
// One TU per kernel family, so that the families compile in parallel (gemv_kernels.cuh).
#include "gemv_kernels.cuh"

namespace dflash {
namespace cuda {

void launch_argmax(const GemmArgs &a) { launch_family<Epilogue::Argmax, kPlain>(a); }

void setup_argmax() { allow_family_smem<Epilogue::Argmax, kPlain>(); }

}  // namespace cuda
}  // namespace dflash
