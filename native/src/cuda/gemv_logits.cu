// gemv_logits.cu: the lm_head's fp32 logits (logits): gemm_stream_kernel<KS, Logits, ...>,
// gemm_mma_kernel<KS, Logits>.
// One TU per kernel family, so that the families compile in parallel (gemv_kernels.cuh).
#include "gemv_kernels.cuh"

namespace dflash {
namespace cuda {

void launch_logits(const GemmArgs &a) { launch_family<Epilogue::Logits, kPlain>(a); }

void setup_logits() { allow_family_smem<Epilogue::Logits, kPlain>(); }

}  // namespace cuda
}  // namespace dflash
