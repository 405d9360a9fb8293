// gemv_store.cu: the plain store GEMM (gemm without a fused norm or sums): gemm_stream_kernel<KS, Store,
// ..., kPlain> and gemm_mma_kernel<KS, Store>.
// One TU per kernel family, so that the families compile in parallel (gemv_kernels.cuh).
#include "gemv_kernels.cuh"

namespace dflash {
namespace cuda {

void launch_store(const GemmArgs &a) { launch_family<Epilogue::Store, kPlain>(a); }

StreamOccupancy setup_store() { return setup_family<Epilogue::Store, kPlain>(); }

#ifdef DFLASH_PHASE_PROBE
// gemm_chain_bench --probe: this TU's GEMM table (out nullptr zeroes it, else it is read into out; returns the
// stamps per row), and the shape whose launches stamp it.
int probe_table_gemm(std::vector<unsigned long long> *out) {
    void *sym = nullptr;
    DFLASH_CUDA_CHECK(cudaGetSymbolAddress(&sym, g_probe_gemm));
    return probe_table_io(sym, out);
}
void probe_gemm_select(int64_t n, int64_t k) {
    const int64_t shape[2] = {n, k};
    DFLASH_CUDA_CHECK(cudaMemcpyToSymbol(g_probe_gemm_shape, shape, sizeof shape));
}
#endif

}  // namespace cuda
}  // namespace dflash
