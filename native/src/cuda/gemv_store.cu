// gemv_store.cu: the plain store GEMM (gemm without a fused norm or sums): gemm_stream_kernel<KS, Store,
// ..., kPlain> and gemm_mma_kernel<KS, Store>.
// One TU per kernel family, so that the families compile in parallel (gemv_kernels.cuh).
#include "gemv_kernels.cuh"

namespace dflash {
namespace cuda {

bool launch_store(const GemmArgs &a) { return launch_family<Epilogue::Store, kPlain>(a); }

StreamOccupancy setup_store() { return setup_family<Epilogue::Store, kPlain>(); }

DFLASH_GEMM_PROBE_ACCESSORS(store)

}  // namespace cuda
}  // namespace dflash
