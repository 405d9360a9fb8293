// gemv_swiglu.cu: the fused GEMM + SwiGLU (gemm_swiglu), plain and with a folded norm: gemm_stream_kernel<KS,
// SwiGLU, ..., kPlain> and <KS, SwiGLU, ..., kNorm>. Both families in one TU: each alone compiles in half the
// time of the other families' TUs (gemv_kernels.cuh).
#include "gemv_kernels.cuh"

namespace dflash {
namespace cuda {

void launch_swiglu(const GemmArgs &a) { launch_family<Epilogue::SwiGLU, kPlain>(a); }

StreamOccupancy setup_swiglu() { return setup_family<Epilogue::SwiGLU, kPlain>(); }

void launch_swiglu_norm(const GemmArgs &a) { launch_family<Epilogue::SwiGLU, kNorm>(a); }

StreamOccupancy setup_swiglu_norm() { return setup_family<Epilogue::SwiGLU, kNorm>(); }

DFLASH_GEMM_PROBE_ACCESSORS(swiglu)

}  // namespace cuda
}  // namespace dflash
