// common.cuh: CUDA error checks and bf16 / warp helpers shared by the cuda backend's kernels.
//
// DFLASH_CUDA_CHECK turns a failed CUDA call into an Error carrying the CUDA error name, the
// call and where it happened; api.cpp turns that into DFLASH_STATUS_CUDA_ERROR (or
// OUT_OF_MEMORY / NO_DEVICE). It never exits the process.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda.h>  // CUtensorMap (a type only: the driver's functions come through cudaGetDriverEntryPointByVersion)
#include <cuda_runtime.h>

#include <cstdlib>
#include <utility>
#include <vector>

#include "../common.hpp"

namespace dflash {

inline dflash_status cuda_status(cudaError_t err) {
    switch (err) {
        case cudaErrorMemoryAllocation: return DFLASH_STATUS_OUT_OF_MEMORY;
        case cudaErrorNoDevice:
        case cudaErrorInsufficientDriver:
        case cudaErrorInvalidDevice: return DFLASH_STATUS_NO_DEVICE;
        default: return DFLASH_STATUS_CUDA_ERROR;
    }
}

[[noreturn]] inline void cuda_fail(cudaError_t err, const char *call, const char *file, int line) {
    fail(cuda_status(err), call, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
         ") at ", file, ":", line);
}

}  // namespace dflash

#define DFLASH_CUDA_CHECK(call)                                                     \
    do {                                                                            \
        cudaError_t dflash_err_ = (call);                                           \
        if (dflash_err_ != cudaSuccess) {                                           \
            (void)cudaGetLastError(); /* clear a non-sticky error for later calls */ \
            ::dflash::cuda_fail(dflash_err_, #call, __FILE__, __LINE__);            \
        }                                                                           \
    } while (0)

// After a launch: a bad configuration shows up here, not at the next unrelated call.
#define DFLASH_CUDA_LAUNCHED() DFLASH_CUDA_CHECK(cudaGetLastError())

namespace dflash {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ bf16 to_bf16(float v) { return __float2bfloat16_rn(v); }
// silu(g) * u, as the swiglu kernel and the GEMM's fused SwiGLU epilogue both compute it.
__device__ __forceinline__ float swiglu_value(float g, float u) { return g / (1.f + expf(-g)) * u; }

// 8 bf16 packed in 16 bytes (one vector load) -> 8 floats.
__device__ __forceinline__ void unpack8(const uint4 &v, float out[8]) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// Butterfly reductions: every lane ends with the result, in a fixed order (deterministic).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024), fixed order; every
// thread gets the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// c += A B: one tensor-core mma.sync m16n8k16, bf16 inputs, fp32 accumulators. a0..a3 and b0, b1
// are the PTX fragments (a0: row g, k 2q..2q+1; a1: row g+8; a2/a3: the same at k+8; b0: k 2q..
// 2q+1 of column g, b1 at k+8; g = lane / 4, q = lane % 4); c0, c1: row g, columns 2q, 2q+1;
// c2, c3: row g + 8.
__device__ __forceinline__ void mma_bf16_16816(float c[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ldmatrix: 8 x 8 b16 matrices from shared memory (addr: this lane's row, a shared-space address) into mma
// fragments; x4 / x2: four or two matrices (lanes 0-7 address matrix 0's rows, 8-15 matrix 1's, ...); trans:
// transposed (the B fragments of a row-major [k][n] tile).
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                            uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                                  uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t addr, uint32_t &r0, uint32_t &r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr)
                 : "memory");
}

// 16 bytes global -> shared, bypassing L1 (cp.async.cg); zero-filled (nothing read) when !valid. Only
// for weights or for what pdl_wait has made visible: the copy is an ordinary (coherent) L2 read.
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    const unsigned dst = unsigned(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Shared-memory mbarriers (sm_80+): init with an arrival count, arrive (release: this thread's earlier
// shared-memory accesses are ordered before what a waiter does after its wait), and wait for the
// completion of the phase of the given parity (acquire). Phase k of a barrier completes when `count`
// threads have arrived for the k-th time; its parity is k & 1.
__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(unsigned(__cvta_generic_to_shared(bar))),
                 "r"(count)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(
                     unsigned(__cvta_generic_to_shared(bar)))
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // try_wait may suspend the thread a while; sm_80 polls
    asm volatile(
        "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT;\n}\n" ::"r"(unsigned(__cvta_generic_to_shared(bar))),
        "r"(parity)
        : "memory");
#else
    asm volatile(
        "{\n .reg .pred done;\n WAIT:\n mbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT;\n}\n" ::"r"(unsigned(__cvta_generic_to_shared(bar))),
        "r"(parity)
        : "memory");
#endif
}

// The bulk-copy engine (sm_90+; elsewhere these trap, and the host never launches them there: DeviceFacts::bulk_ok).
// bulk_expect(bar, bytes): one arrival on bar that also expects `bytes` to land by bulk copies in its phase;
// bulk_copy(dst, src, bytes, bar): global -> shared, 16-byte aligned, bytes % 16 == 0, completing `bytes` of bar's
// phase as they land (an L2 read, as cp.async.cg's). fence_proxy_async: this thread's generic shared-memory
// accesses so far are ordered before later async-proxy (bulk copy) accesses: before a bulk copy refills what
// this thread read, or after a barrier's init.
__device__ __forceinline__ void bulk_expect(uint64_t *bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
                     unsigned(__cvta_generic_to_shared(bar))),
                 "r"(bytes)
                 : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, unsigned bytes, uint64_t *bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            unsigned(__cvta_generic_to_shared(dst))),
        "l"(src), "r"(bytes), "r"(unsigned(__cvta_generic_to_shared(bar)))
        : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
    __trap();
#endif
}
// One box of a 2-D tensor map (global -> shared, the map's swizzle and zero fill), coordinates {c0, c1} (innermost
// first), completing the box's bytes (all of them, filled or not) on bar. dst 128-byte aligned (1024 with the
// 128-byte swizzle, whose pattern follows the address); map: a __grid_constant__ kernel parameter.
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, int c0, int c1, uint64_t *bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];\n" ::"r"(unsigned(__cvta_generic_to_shared(dst))),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(unsigned(__cvta_generic_to_shared(bar)))
        : "memory");
#else
    __trap();
#endif
}
// After mbar_init of barriers that bulk copies complete: the inits visible to the async proxy.
__device__ __forceinline__ void fence_bar_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    fence_proxy_async();
#else
    __trap();
#endif
}

// Programmatic dependent launch (sm_90+, on by default; DFLASH_PDL=0 turns it off; measured on the
// H200: propose 4-6% and decode 4% faster, verify the same): kernels are launched with programmatic
// stream serialization, so the next kernel's blocks may be scheduled while this one drains. Most
// kernels start with pdl_prologue(): it lets its own successor launch, then waits until every
// kernel before it has finished and its writes are visible; nothing before that wait touches
// memory that an earlier kernel writes. The GEMMs (gemm_stream_kernel, gemm_wide_kernel) stream
// their constant weights' first chunks before the wait, and let their successor launch at their
// start, once their last weight load is issued or after their k loop (gemv.cu's pdl_trigger; the
// wide GEMM always after). Launched without the attribute (DFLASH_PDL=0), both instructions return
// at once (CUTLASS and rtp-llm kernels carry them the same way); below sm_90 they are absent.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_prologue() {
    pdl_launch_dependents();
    pdl_wait();
}

// The phase probe (off unless the build defines DFLASH_PHASE_PROBE: cmake -DDFLASH_PHASE_PROBE=ON, for
// tools/gemm_chain_bench --probe): a probed kernel's thread 0 stamps %globaltimer at fixed points of its block
// into its translation unit's table (row: the block's linear index, column: the point), so a tool sees where
// the attention phase's microseconds go, block by block. Each launch overwrites the rows of its blocks.
constexpr int kProbeBlocks = 4096, kProbeStamps = 12;
#ifdef DFLASH_PHASE_PROBE
__device__ __forceinline__ unsigned long long probe_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define DFLASH_PROBE_TABLE(name) __device__ unsigned long long name[kProbeBlocks * kProbeStamps]
#define DFLASH_PROBE(name, point)                                                                         \
    do {                                                                                                  \
        const unsigned probe_b_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);         \
        if (threadIdx.x == 0 && probe_b_ < unsigned(kProbeBlocks)) name[probe_b_ * kProbeStamps + (point)] = probe_now(); \
    } while (0)
// A table's host side (`table`, the __device__ array DFLASH_PROBE_TABLE declared): out nullptr zeroes it, else it
// is read into out. Returns the stamps per row (kProbeStamps), so a reader never repeats the table's layout.
template <class Table>
int probe_table_io(const Table &table, std::vector<unsigned long long> *out) {
    void *sym = nullptr;
    DFLASH_CUDA_CHECK(cudaGetSymbolAddress(&sym, table));
    const size_t bytes = size_t(kProbeBlocks) * kProbeStamps * sizeof(unsigned long long);
    if (!out) {
        DFLASH_CUDA_CHECK(cudaMemset(sym, 0, bytes));
        return kProbeStamps;
    }
    out->assign(size_t(kProbeBlocks) * kProbeStamps, 0);
    DFLASH_CUDA_CHECK(cudaMemcpy(out->data(), sym, bytes, cudaMemcpyDeviceToHost));
    return kProbeStamps;
}
#else
#define DFLASH_PROBE(name, point) \
    do {                          \
    } while (0)
#endif

// Loads of what an earlier kernel wrote (activations, caches) must be coherent ld.global, never
// ld.global.nc (__ldg, or what the compiler makes of a const __restrict__ pointer): with
// programmatic dependent launch the writer may still run while this kernel starts, and a
// non-coherent load's data must be read-only for the whole life of the kernel, so nothing keeps
// one below pdl_wait (the H200 showed it: the tiled GEMM with x two chunks ahead read stale x
// under PDL and never without). Weights, constant for the library's life, may take the
// read-only path. asm volatile keeps these after the (volatile) wait.
__device__ __forceinline__ uint4 load_act16(const void *p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ uint32_t load_act_u16(const void *p) {
    unsigned short v;
    asm volatile("ld.global.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ float load_act_f32(const float *p) {
    float v;
    asm volatile("ld.global.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
    return v;
}

// A kill switch of the environment: on unless the variable is set to something starting with "0".
// Callers read it once (a function-local static) so a switch holds for the process.
inline bool env_switch_on(const char *name) {
    const char *v = std::getenv(name);
    return !(v && v[0] == '0');
}

// An opt-in switch of the environment (a diagnostic or an A/B switch, off by default): on where the variable is set
// to something other than empty or a value starting with "0", env_switch_on's off. Callers read it once too.
inline bool env_opt_in(const char *name) {
    const char *v = std::getenv(name);
    return v && v[0] && v[0] != '0';
}

// A whole-number setting of the environment: `fallback` where unset or empty, the number where it is one in
// [lo, hi], else not ok. Callers read it once (a function-local static) and pass it through env_value at every
// call, so a bad value fails every call, with DFLASH_STATUS_INVALID_ARGUMENT naming the variable and `what`.
struct EnvInt {
    int64_t value;
    bool ok;
};
inline EnvInt env_int(const char *name, int64_t fallback, int64_t lo, int64_t hi) {
    const char *v = std::getenv(name);
    if (!v || !*v) return {fallback, true};
    char *end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    return *end == '\0' && n >= lo && n <= hi ? EnvInt{int64_t(n), true} : EnvInt{0, false};
}
inline int64_t env_value(const EnvInt &e, const char *name, const char *what) {
    if (!e.ok) fail(DFLASH_STATUS_INVALID_ARGUMENT, name, "=", std::getenv(name), " ", what);
    return e.value;
}

// Whether launches on the current device use programmatic stream serialization: compute
// capability 9.0 or newer, unless DFLASH_PDL=0.
bool pdl_enabled();
// The shared memory carveout every launch asks for (cudaLaunchAttributePreferredSharedMemoryCarveout, percent of
// the unified L1/shared memory), or -1 (the default: no attribute, the driver picks per kernel).
// DFLASH_SMEM_CARVEOUT=100 lets blocks of kernels the driver would configure apart share an SM (session 33's probe:
// o_proj's blocks then start beside attention's at one row), but measured no faster (docs/speed-log.md).
int smem_carveout();

// kernel<<<grid, block, smem, s>>>(args...), or the same through cudaLaunchKernelEx with
// programmatic stream serialization where pdl_enabled() and the carveout where smem_carveout() asks for one; a bad
// configuration throws here.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
            Args &&...args) {
    const bool pdl = pdl_enabled();
    const int carveout = smem_carveout();
    if (!pdl && carveout < 0) {
        kernel<<<grid, block, smem, s>>>(std::forward<Args>(args)...);
        DFLASH_CUDA_LAUNCHED();
        return;
    }
    cudaLaunchAttribute attr[2];
    unsigned n_attrs = 0;
    if (pdl) {
        attr[n_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n_attrs++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (carveout >= 0) {
        attr[n_attrs].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
        attr[n_attrs++].val.sharedMemCarveout = unsigned(carveout);
    }
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = s;
    config.attrs = attr;
    config.numAttrs = n_attrs;
    DFLASH_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline unsigned grid_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

}  // namespace dflash
