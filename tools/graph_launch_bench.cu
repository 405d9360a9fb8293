// graph_launch_bench.cu: what a step's CUDA graph costs to launch on this machine, by node count, by how the
// step is cut into graphs, and by what the kernels do. A standalone probe (not part of the library) for the GPU's
// idle time at a step's start that `bench.py --timeline` reports (session 37: 166-178 us for a 331-node verify or
// decode graph, 63 us for a 57-node propose, on an H100).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/graph_launch_bench.cu -o build/graph_launch_bench && build/graph_launch_bench
//
// Each graph is a chain of N kernels captured with programmatic stream serialization (as the library's launches):
// each kernel lets the next launch at its start and waits for its predecessor, then spins for `us` microseconds
// of %globaltimer on 132 blocks, or 2 * `us` thousand SM clock cycles (a lower clock after idling would show), or
// spins in one of 8 distinct kernels taking a 256-byte parameter block, with and without cudaGraphUpload after
// instantiation (the library does not upload; not run yet: session 37 wrote these after its device time), or reads its own 32 MiB slice of a 4 GiB buffer with 16-byte loads (memory-bound, as the GEMMs). Options per row:
// a 4 KB pinned upload before the graph (a step's arguments) and a busy-wait on the host between steps (Python's
// time between bench.py's steps). Per configuration, medians of 50 steps:
//   host      the host's wall time of the launch calls alone (cudaGraphLaunch, every piece)
//   plain     event to event around the launches on an idle GPU, as bench.py times a step
//   queued    the same with a 3 ms sleep kernel queued first, so every launch is in before the GPU reaches it
//   idle      plain - queued: the GPU's idle time at the step's start, waiting for the host
// Configurations: one graph of N nodes; the same N nodes cut into pieces launched back to back; plain stream
// launches for scale. Session 37 on an H100 (driver 13.0): one graph of 331 nodes launched in 1.8-3.7 us of host
// time with 0.3-2.8 us idle, whatever the kernels did or the host gap; cutting it changed nothing; 331 stream
// launches took 713 us of host time. So a graph's launch is not what leaves the library's steps idle at their start.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CHECK(x)                                                                                      \
    do {                                                                                              \
        cudaError_t e_ = (x);                                                                         \
        if (e_ != cudaSuccess) {                                                                      \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));  \
            std::exit(1);                                                                             \
        }                                                                                             \
    } while (0)

__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin_kernel(uint64_t ns, int *sink) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const uint64_t t0 = now_ns();
    while (now_ns() - t0 < ns) {
    }
    if (threadIdx.x == 0 && sink) *sink += 1;
}

// The same in SM clock cycles: its wall time follows the SM clock (an idle GPU's lower clock would show here).
__global__ void cycles_kernel(uint64_t ns, int *sink) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const long long t0 = clock64(), cycles = (long long)ns * 2;  // about ns at 2 GHz
    while (clock64() - t0 < cycles) {
    }
    if (threadIdx.x == 0 && sink) *sink += 1;
}

// A memory-bound stand-in: reads `bytes` of weights (its own slice of a buffer far past L2) with 16-byte loads.
__global__ void stream_kernel(const uint4 *w, uint64_t n16, int *sink) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    uint32_t acc = 0;
    for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n16; i += uint64_t(gridDim.x) * blockDim.x) {
        const uint4 v = __ldg(w + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u && sink) *sink = int(acc);
}

// Distinct kernels with a 256-byte parameter block (as the library's GEMM and attention launches carry), spinning
// like spin_kernel: whether a graph of many different kernels with large parameters starts later.
struct BigParams {
    uint64_t ns;
    int *sink;
    uint64_t pad[30];
};
template <int K>
__global__ void mixed_kernel(BigParams p) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const uint64_t t0 = now_ns();
    while (now_ns() - t0 < p.ns + K) {
    }
    if (threadIdx.x == 0 && p.sink && p.pad[K] == 1) *p.sink += K;
}

__global__ void sleep_kernel(uint64_t ns) {
    const uint64_t t0 = now_ns();
    while (now_ns() - t0 < ns) {
    }
}

enum class Work { Ns, Cycles, Stream, Mixed };
static Work g_work = Work::Ns;
static const uint4 *g_weights = nullptr;  // Stream: kernel i reads slice i % g_slices
static uint64_t g_slice16 = 0, g_slices = 1, g_next_slice = 0;

static void launch_spin(cudaStream_t s, uint64_t ns, int *sink, int blocks) {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(128);
    cfg.stream = s;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    if (g_work == Work::Ns) {
        CHECK(cudaLaunchKernelEx(&cfg, spin_kernel, ns, sink));
    } else if (g_work == Work::Mixed) {
        static int next = 0;
        BigParams p = {};
        p.ns = ns;
        p.sink = sink;
        switch (next++ % 8) {
            case 0: CHECK(cudaLaunchKernelEx(&cfg, mixed_kernel<0>, p)); break;
            case 1: CHECK(cudaLaunchKernelEx(&cfg, mixed_kernel<1>, p)); break;
            case 2: CHECK(cudaLaunchKernelEx(&cfg, mixed_kernel<2>, p)); break;
            case 3: CHECK(cudaLaunchKernelEx(&cfg, mixed_kernel<3>, p)); break;
            case 4: CHECK(cudaLaunchKernelEx(&cfg, mixed_kernel<4>, p)); break;
            case 5: CHECK(cudaLaunchKernelEx(&cfg, mixed_kernel<5>, p)); break;
            case 6: CHECK(cudaLaunchKernelEx(&cfg, mixed_kernel<6>, p)); break;
            default: CHECK(cudaLaunchKernelEx(&cfg, mixed_kernel<7>, p)); break;
        }
    } else if (g_work == Work::Cycles) {
        CHECK(cudaLaunchKernelEx(&cfg, cycles_kernel, ns, sink));
    } else {
        cfg.blockDim = dim3(512);
        cfg.gridDim = dim3(2 * 132);
        const uint4 *w = g_weights + (g_next_slice++ % g_slices) * g_slice16;
        CHECK(cudaLaunchKernelEx(&cfg, stream_kernel, w, g_slice16, sink));
    }
}

static bool g_graph_upload = true;  // cudaGraphUpload after instantiating

static cudaGraphExec_t capture(cudaStream_t s, int n, uint64_t ns, int *sink, int blocks) {
    cudaGraph_t g;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; ++i) launch_spin(s, ns, sink, blocks);
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    CHECK(cudaGraphDestroy(g));
    if (g_graph_upload) CHECK(cudaGraphUpload(exec, s));  // the library does not (cuda_backend.cu end_capture)
    return exec;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct Result {
    double host, plain, queued;
};

// pieces: the node counts of the graphs launched back to back (empty: plain stream launches of n kernels).
static int *g_dev_args = nullptr, *g_pinned_args = nullptr;
static bool g_upload = false;   // a 4 KB pinned upload before the graph, as a step's arguments
static int g_host_gap_us = 0;   // host time between steps (Python's, in bench.py), after the previous step's sync

static Result measure(cudaStream_t s, const std::vector<int> &pieces, int n, uint64_t ns, int *sink, int blocks) {
    std::vector<cudaGraphExec_t> execs;
    for (int p : pieces) execs.push_back(capture(s, p, ns, sink, blocks));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<double> host, plain, queued;
    for (int it = 0; it < 110; ++it) {
        const bool q = it % 2;
        CHECK(cudaStreamSynchronize(s));
        if (g_host_gap_us) {
            const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(g_host_gap_us);
            while (std::chrono::steady_clock::now() < until) {
            }
        }
        if (q) sleep_kernel<<<1, 32, 0, s>>>(3000000);
        CHECK(cudaEventRecord(e0, s));
        const auto t0 = std::chrono::steady_clock::now();
        if (g_upload) CHECK(cudaMemcpyAsync(g_dev_args, g_pinned_args, 4096, cudaMemcpyHostToDevice, s));
        if (execs.empty())
            for (int i = 0; i < n; ++i) launch_spin(s, ns, sink, blocks);
        for (cudaGraphExec_t e : execs) CHECK(cudaGraphLaunch(e, s));
        const auto t1 = std::chrono::steady_clock::now();
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (it < 10) continue;  // warm-up
        (q ? queued : plain).push_back(ms * 1e3);
        if (!q) host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    for (cudaGraphExec_t e : execs) CHECK(cudaGraphExecDestroy(e));
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    return {median(host), median(plain), median(queued)};
}

int main(int argc, char **argv) {
    const int blocks = argc > 1 ? std::atoi(argv[1]) : 132;
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    int driver = 0, runtime = 0;
    CHECK(cudaDriverGetVersion(&driver));
    CHECK(cudaRuntimeGetVersion(&runtime));
    std::printf("device: %s, driver %d, runtime %d; %d blocks of 128 threads per kernel\n", prop.name, driver,
                runtime, blocks);
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int *sink;
    CHECK(cudaMalloc(&sink, sizeof(int)));
    CHECK(cudaMalloc(&g_dev_args, 4096));
    CHECK(cudaMallocHost(&g_pinned_args, 4096));
    const uint64_t weight_bytes = 4ull << 30;  // 4 GiB: 128 slices of 32 MiB, far past L2
    void *weights = nullptr;
    CHECK(cudaMalloc(&weights, weight_bytes));
    CHECK(cudaMemset(weights, 1, weight_bytes));
    g_weights = static_cast<const uint4 *>(weights);
    g_slices = 128;
    g_slice16 = weight_bytes / g_slices / 16;
    struct Config {
        const char *what;
        int n;
        double us;
        std::vector<int> pieces;
        Work work = Work::Ns;
        bool upload = false;
        int gap_us = 0;
        bool graph_upload = true;
    };
    const std::vector<Config> configs = {
        {"one graph, 8 kernels x 256-byte params", 331, 15, {331}, Work::Mixed},
        {"the same, not cudaGraphUpload-ed (as the library)", 331, 15, {331}, Work::Mixed, false, 0, false},
        {"the same, upload first, 100 us host gap", 331, 15, {331}, Work::Mixed, true, 100, false},
        {"one graph, 8 kernels x 256-byte params", 57, 15, {57}, Work::Mixed},
        {"one graph, SM-clock spins", 331, 15, {331}, Work::Cycles},
        {"one graph, SM-clock spins, 100 us host gap", 331, 15, {331}, Work::Cycles, false, 100},
        {"one graph, 32 MiB reads", 331, 0, {331}, Work::Stream},
        {"one graph, 32 MiB reads, upload first", 331, 0, {331}, Work::Stream, true},
        {"one graph, 32 MiB reads, upload, 100 us host gap", 331, 0, {331}, Work::Stream, true, 100},
        {"one graph, 32 MiB reads, upload, 1000 us host gap", 331, 0, {331}, Work::Stream, true, 1000},
        {"one graph, 32 MiB reads", 57, 0, {57}, Work::Stream},
        {"one graph, 32 MiB reads, upload, 100 us host gap", 57, 0, {57}, Work::Stream, true, 100},
        {"one graph", 57, 15, {57}},
        {"one graph", 331, 15, {331}},
        {"one graph", 331, 2, {331}},
        {"8 + 49", 57, 15, {8, 49}},
        {"10 + 321", 331, 15, {10, 321}},
        {"28 + 303", 331, 15, {28, 303}},
        {"10 + 40 + 281", 331, 15, {10, 40, 281}},
        {"10 + 4 x 80 + 1", 331, 15, {10, 80, 80, 80, 80, 1}},
        {"stream launches", 57, 15, {}},
        {"stream launches", 331, 15, {}},
    };
    std::printf("| graphs | kernels | us each | host launch (us) | plain (us) | queued (us) | idle at start (us) |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    for (const Config &c : configs) {
        g_work = c.work;
        g_upload = c.upload;
        g_host_gap_us = c.gap_us;
        g_next_slice = 0;
        g_graph_upload = c.graph_upload;
        const Result r = measure(s, c.pieces, c.n, uint64_t(c.us * 1e3), sink, blocks);
        std::printf("| %s | %d | %.0f | %.1f | %.1f | %.1f | %.1f |\n", c.what, c.n, c.us, r.host, r.plain, r.queued,
                    r.plain - r.queued);
        std::fflush(stdout);
    }
    CHECK(cudaFree(sink));
    CHECK(cudaFree(weights));
    CHECK(cudaFree(g_dev_args));
    CHECK(cudaFreeHost(g_pinned_args));
    CHECK(cudaStreamDestroy(s));
    return 0;
}
