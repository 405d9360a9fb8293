// graph_launch_bench.cu: what a step's CUDA graph costs to launch on this machine, by node count and by how the
// step is cut into graphs. A standalone probe (not part of the library) for the GPU's idle time at a step's start
// that `bench.py --timeline` reports (session 37: 166-178 us for a 331-node verify or decode graph, 63 us for a
// 57-node propose, on an H100).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/graph_launch_bench.cu -o build/graph_launch_bench && build/graph_launch_bench
//
// Each graph is a chain of N kernels captured with programmatic stream serialization (as the library's launches):
// each kernel lets the next launch at its start, waits for its predecessor, then spins for `us` microseconds on
// one block (a stand-in for a layer's kernels; the GPU's work per kernel, not the launch, sets the step's floor).
// Per configuration, medians of 50 steps:
//   host      the host's wall time of the launch calls alone (cudaGraphLaunch, every piece)
//   plain     event to event around the launches on an idle GPU, as bench.py times a step
//   queued    the same with a 3 ms sleep kernel queued first, so every launch is in before the GPU reaches it
//   idle      plain - queued: the GPU's idle time at the step's start, waiting for the host
// Configurations: one graph of N nodes; the same N nodes cut into a first piece of F nodes and the rest
// (the first piece starts the GPU while the host launches the rest); and plain stream launches for scale.
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

__global__ void sleep_kernel(uint64_t ns) {
    const uint64_t t0 = now_ns();
    while (now_ns() - t0 < ns) {
    }
}

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
    CHECK(cudaLaunchKernelEx(&cfg, spin_kernel, ns, sink));
}

static cudaGraphExec_t capture(cudaStream_t s, int n, uint64_t ns, int *sink, int blocks) {
    cudaGraph_t g;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; ++i) launch_spin(s, ns, sink, blocks);
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaGraphUpload(exec, s));
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
        if (q) sleep_kernel<<<1, 32, 0, s>>>(3000000);
        CHECK(cudaEventRecord(e0, s));
        const auto t0 = std::chrono::steady_clock::now();
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
    struct Config {
        const char *what;
        int n;
        double us;
        std::vector<int> pieces;
    };
    const std::vector<Config> configs = {
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
        const Result r = measure(s, c.pieces, c.n, uint64_t(c.us * 1e3), sink, blocks);
        std::printf("| %s | %d | %.0f | %.1f | %.1f | %.1f | %.1f |\n", c.what, c.n, c.us, r.host, r.plain, r.queued,
                    r.plain - r.queued);
        std::fflush(stdout);
    }
    CHECK(cudaFree(sink));
    CHECK(cudaStreamDestroy(s));
    return 0;
}
