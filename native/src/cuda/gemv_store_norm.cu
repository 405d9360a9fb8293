// gemv_store_norm.cu: the store GEMM with a folded norm (GemmFuse::norm_eps): gemm_stream_kernel<KS, Store,
// ..., kNorm>.
// One TU per kernel family, so that the families compile in parallel (gemv_kernels.cuh).
#include "gemv_kernels.cuh"

namespace dflash {
namespace cuda {

bool launch_store_norm(const GemmArgs &a) { return launch_family<Epilogue::Store, kNorm>(a); }

StreamOccupancy setup_store_norm() { return setup_family<Epilogue::Store, kNorm>(); }

DFLASH_GEMM_PROBE_ACCESSORS(store_norm)

}  // namespace cuda
}  // namespace dflash
