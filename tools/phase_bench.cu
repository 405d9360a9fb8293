// phase_bench.cu: what a GEMM boundary costs when a step streams its weights as a chain of GEMMs, and what
// one persistent kernel with grid barriers would save. A standalone probe (not part of the library), the
// question behind docs/speed-log.md's "next lever": the GEMMs stream at the read ceiling in steady state, so
// the gap to the floor is what every launch adds.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/phase_bench.cu -o build/phase_bench && build/phase_bench
//
// A "phase" is one GEMM's weight stream at decode: every warp of a 2-blocks-per-SM grid reads its own
// contiguous share through a private 6-chunk cp.async ring (gemv.cu's persistent kernel's shape), a few
// mma per chunk, and it depends on the phase before it through a small x buffer (read after the wait,
// written at the end). A decode layer of Qwen3-8B is four phases (q/k/v 50 MB, o_proj 33.5 MB, gate/up
// 201 MB, down 100 MB); 36 layers stream 14.0 GB. Variants (session 17 on an H200: docs/speed-log.md's "What a
// launch costs"):
//   one phase        all 36 layers' bytes as one launch: the streaming ceiling for this pattern
//   launches         144 launches, serialized
//   launches + PDL   144 launches with programmatic dependent launch: each fills its ring before it waits
//                    (the library's way); also with three small dependent kernels after each q/k/v phase,
//                    where rope + cache write, attention and the combine run
//   persistent       one cooperative launch, the 144 phases separated by grid barriers; each warp's chunk
//                    sequence runs through all phases, so the next phase's first chunks are in flight
//                    before the barrier
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_common.cuh"

constexpr int S = 6;  // ring chunks per warp (gemv.cu's persistent kernel)

struct Phase {
    int64_t base_chunk;       // the phase's first 2 KB chunk in the buffer
    int64_t chunks_per_warp;  // warp w reads chunks base + w * cpw .. + cpw - 1
};

__device__ __forceinline__ void wait_ring() { wait_group<S - 2>(); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
// A warp's chunk sequence over phases [first, last): fill() walks it, the consumer reads it in order.
struct Stream {
    const uint4 *buf;
    const Phase *phases;
    int last, f_phase;
    int64_t f_j, filled;
    unsigned ring_s;
    int lane;
    int64_t gw;
    __device__ void fill() {
        const Phase &p = phases[f_phase];
        const uint4 *src = buf + (p.base_chunk + gw * p.chunks_per_warp + f_j) * 128;
        const unsigned dst = ring_s + unsigned(filled % S) * 2048;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = lane + 32 * k, r = i >> 3, part = i & 7;
            cp16(dst + r * 128 + ((part ^ (r & 7)) << 4), src + i);
        }
        ++filled;
        if (++f_j == p.chunks_per_warp) f_j = 0, ++f_phase;
    }
    __device__ bool more() const { return f_phase < last; }
};

// The grid barrier of the persistent variant: arrival count and generation (all blocks resident: a
// cooperative launch).
__device__ void grid_barrier(unsigned *count, volatile unsigned *gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned g = *gen;
        __threadfence();
        if (atomicAdd(count, 1u) == gridDim.x - 1) {
            *count = 0;
            __threadfence();
            atomicAdd(const_cast<unsigned *>(gen), 1u);
        } else {
            while (*gen == g) __nanosleep(32);
        }
        __threadfence();
    }
    __syncthreads();
}

// Phases [first, last) of `phases`; with barriers, a grid barrier between them (the persistent variant);
// else one phase per launch (last = first + 1). x: [phases + 1][gridDim.x] floats, phase i reads row i.
__global__ void __launch_bounds__(kWarps * 32, 2)
phase_kernel(const uint4 *buf, const Phase *phases, int first, int last, float *x, unsigned *bar_count,
             unsigned *bar_gen, bool pdl) {
    extern __shared__ __align__(16) unsigned char smem[];
    if (pdl) pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    Stream st{buf, phases, last, first, 0, 0, unsigned(__cvta_generic_to_shared(smem + warp * S * 2048)), lane,
              int64_t(blockIdx.x) * kWarps + warp};
    for (int i = 0; i < S - 1; ++i) {
        if (st.more()) st.fill();
        commit();
    }
    if (pdl) pdl_wait();
    int64_t read = 0;
    for (int ph = first; ph < last; ++ph) {
        if (ph > first) grid_barrier(bar_count, bar_gen);
        const float xin = *reinterpret_cast<volatile float *>(x + int64_t(ph) * gridDim.x + (blockIdx.x + 1) % gridDim.x);
        uint32_t xv = __float_as_uint(xin) | 0x3c003c00u;
        float acc[2][4] = {};
        for (int64_t j = 0; j < phases[ph].chunks_per_warp; ++j, ++read) {
            wait_ring();
            __syncwarp();
            if (st.more()) st.fill();
            commit();
            const unsigned char *slot = smem + warp * S * 2048 + (read % S) * 2048;
            uint32_t wb[2][8];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const int row = nt * 8 + g;
                const uint4 v0 = *reinterpret_cast<const uint4 *>(slot + row * 128 + (((2 * q) ^ (row & 7)) << 4));
                const uint4 v1 = *reinterpret_cast<const uint4 *>(slot + row * 128 + (((2 * q + 1) ^ (row & 7)) << 4));
                wb[nt][0] = v0.x, wb[nt][1] = v0.y, wb[nt][2] = v0.z, wb[nt][3] = v0.w;
                wb[nt][4] = v1.x, wb[nt][5] = v1.y, wb[nt][6] = v1.z, wb[nt][7] = v1.w;
            }
#pragma unroll
            for (int s2 = 0; s2 < 4; ++s2)
#pragma unroll
                for (int t = 0; t < 2; ++t) mma16816(acc[t], xv, xv + 1, xv + 2, xv + 3, wb[t][2 * s2], wb[t][2 * s2 + 1]);
        }
        // the phase's output: one value per block (written by warp 0, lane 0 after a block barrier)
        __shared__ float part[kWarps];
        if (lane == 0) part[warp] = acc[0][0] + acc[1][3];
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = 0.f;
            for (int w = 0; w < kWarps; ++w) v += part[w];
            x[int64_t(ph + 1) * gridDim.x + blockIdx.x] = v * 1e-30f;
        }
    }
}

// A small dependent kernel (attention's place between q/k/v and o_proj: rope + cache write, attention,
// combine): lets its successor launch, waits, then touches `n` floats of its own (1 MB: a few us).
__global__ void small_kernel(float *y, int64_t n) {
    pdl_trigger();
    pdl_wait();
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        y[i] = y[i] * 0.5f + 1.f;
}

int main(int argc, char **argv) {
    const int layers = argc > 1 ? std::atoi(argv[1]) : 36;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t smem = size_t(kWarps) * S * 2048;
    CHECK(cudaFuncSetAttribute(phase_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, phase_kernel, kWarps * 32, smem));
    const int blocks = sms * std::min(per_sm, 2);
    const int64_t warps = int64_t(blocks) * kWarps;
    const int64_t buf_chunks = (int64_t(4) << 30) / 2048;
    uint4 *buf = nullptr;
    CHECK(cudaMalloc(&buf, buf_chunks * 2048));
    CHECK(cudaMemset(buf, 0x3c, buf_chunks * 2048));

    // A decode layer's four GEMMs (MB of bf16 weights), each warp's share in whole chunks.
    const double layer_mb[4] = {50.3, 33.6, 201.3, 100.7};
    std::vector<Phase> phases;
    int64_t next = 0, total_chunks = 0;
    for (int l = 0; l < layers; ++l)
        for (double mb : layer_mb) {
            const int64_t cpw = std::max<int64_t>(1, int64_t(mb * 1e6 / 2048 / double(warps) + 0.5));
            if (next + cpw * warps > buf_chunks) next = 0;
            phases.push_back({next, cpw});
            next += cpw * warps;
            total_chunks += cpw * warps;
        }
    const int n = int(phases.size());
    const double bytes = double(total_chunks) * 2048;
    Phase *d_phases = nullptr;
    CHECK(cudaMalloc(&d_phases, sizeof(Phase) * (n + 1)));
    CHECK(cudaMemcpy(d_phases, phases.data(), sizeof(Phase) * n, cudaMemcpyHostToDevice));
    float *x = nullptr;
    CHECK(cudaMalloc(&x, sizeof(float) * (n + 2) * blocks));
    CHECK(cudaMemset(x, 0, sizeof(float) * (n + 2) * blocks));
    unsigned *bar = nullptr;
    CHECK(cudaMalloc(&bar, 8));
    CHECK(cudaMemset(bar, 0, 8));
    // the single-phase variant: every chunk of every phase as one stream, one launch
    Phase one{0, total_chunks / warps};
    if (one.chunks_per_warp * warps > buf_chunks) one.chunks_per_warp = buf_chunks / warps;
    Phase *d_one = nullptr;
    CHECK(cudaMalloc(&d_one, sizeof(Phase)));
    CHECK(cudaMemcpy(d_one, &one, sizeof(Phase), cudaMemcpyHostToDevice));

    auto launch = [&](const Phase *ps, int first, int last, bool pdl, bool coop) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(kWarps * 32);
        cfg.dynamicSmemBytes = smem;
        cudaLaunchAttribute attr[2];
        int na = 0;
        if (pdl) {
            attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attr[na].val.programmaticStreamSerializationAllowed = 1;
            ++na;
        }
        if (coop) {
            attr[na].id = cudaLaunchAttributeCooperative;
            attr[na].val.cooperative = 1;
            ++na;
        }
        cfg.attrs = attr;
        cfg.numAttrs = na;
        CHECK(cudaLaunchKernelEx(&cfg, phase_kernel, (const uint4 *)buf, ps, first, last, x, bar, bar + 1, pdl));
    };
    std::printf("%d layers, %d phases, %.2f GB, %d blocks (%d per SM)\n", layers, n, bytes / 1e9, blocks, per_sm);
    auto report = [&](const char *name, float ms, double b) {
        std::printf("%-48s %8.3f ms  %6.3f TB/s\n", name, ms, b / (ms * 1e-3) / 1e12);
    };
    const double one_bytes = double(one.chunks_per_warp * warps) * 2048;
    const float t_one = median_ms([&] { launch(d_one, 0, 1, false, false); });
    const double ceiling = one_bytes / (t_one * 1e-3);
    auto over = [&](const char *name, float ms) {
        const double ideal = bytes / ceiling * 1e3;
        std::printf("%-48s %8.3f ms  %6.3f TB/s  %6.2f us per phase over one launch's rate\n", name, ms,
                    bytes / (ms * 1e-3) / 1e12, (ms - ideal) * 1e3 / n);
    };
    report("one phase (all bytes, one launch)", t_one, one_bytes);
    over("launches", median_ms([&] {
             for (int i = 0; i < n; ++i) launch(d_phases, i, i + 1, false, false);
         }));
    over("launches + PDL", median_ms([&] {
             for (int i = 0; i < n; ++i) launch(d_phases, i, i + 1, true, false);
         }));
    float *small = nullptr;
    CHECK(cudaMalloc(&small, 4 << 20));
    CHECK(cudaMemset(small, 0, 4 << 20));
    auto small_launch = [&](int64_t floats) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(sms);
        cfg.blockDim = dim3(256);
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        CHECK(cudaLaunchKernelEx(&cfg, small_kernel, small, floats));
    };
    for (int64_t floats : {int64_t(1) << 12, int64_t(1) << 18}) {
        const float ms = median_ms([&] {
            for (int i = 0; i < n; ++i) {
                launch(d_phases, i, i + 1, true, false);
                if (i % 4 == 0)
                    for (int k = 0; k < 3; ++k) small_launch(floats);
            }
        });
        char name[96];
        std::snprintf(name, sizeof name, "launches + PDL, 3 small kernels (%lld KB) after q/k/v", (long long)floats * 4 / 1024);
        over(name, ms);
    }
    over("persistent, grid barriers (one launch)", median_ms([&] { launch(d_phases, 0, n, false, true); }));
    over("persistent per layer (4 phases), + PDL", median_ms([&] {
             for (int i = 0; i < n; i += 4) launch(d_phases, i, std::min(n, i + 4), true, true);
         }));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaGetLastError());
    std::printf("done\n");
    return 0;
}
