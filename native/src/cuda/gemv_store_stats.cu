// gemv_store_stats.cu: the store GEMM that sums its stored rows' squares (GemmFuse::ss_out): gemm_stream_kernel<KS,
// Store, ..., kStats>.
// One TU per kernel family, so that the families compile in parallel (gemv_kernels.cuh).
#include "gemv_kernels.cuh"

namespace dflash {
namespace cuda {

bool launch_store_stats(const GemmArgs &a) { return launch_family<Epilogue::Store, kStats>(a); }

StreamOccupancy setup_store_stats() { return setup_family<Epilogue::Store, kStats>(); }

DFLASH_GEMM_PROBE_ACCESSORS(store_stats)

}  // namespace cuda
}  // namespace dflash
