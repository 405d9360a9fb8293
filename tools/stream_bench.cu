// stream_bench.cu: how fast can a kernel stream weights into shared memory on this GPU, by access order
// and copy mechanism? A standalone probe for the GEMM ring's design (not part of the library).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/stream_bench.cu -o build/stream_bench && build/stream_bench
//
// Every variant reads the same 4 GiB buffer once per pass (far past the 50 MB L2) and folds what it read
// into a value that is stored, so nothing is optimized away. Bandwidth = bytes read / time (median of 20
// passes after warm-up). The reference: a device-to-device cudaMemcpy (read + write counted).
//   ring-contig   each warp a private ring of S 2 KB chunks filled by cp.async (16 B per lane, as gemv.cu's
//                 tiled GEMM), the warp's chunks one contiguous run of RUN bytes per "tile", tiles scattered
//   ring-lockstep the same ring, but warp w's j-th chunk is chunk j * W + w: at any moment the GPU's warps
//                 read one contiguous front, as a memcpy does
//   bulk-contig   the ring filled by one cp.async.bulk per chunk (lane 0), chunk bytes CH
//   ldg           plain 16-byte loads into registers, 8 in flight per thread, grid-stride (a read-only copy)
//   gemm-like     the ring with gemv.cu's consumer added step by step (mma per chunk; x loaded two chunks ahead;
//                 a block reduce per tile), then one launch per weight-sized read (12-400 MB), two of them timed
//                 per warp (start, first chunk landed, end) with %globaltimer
// Session 17 on an H200: docs/speed-log.md's "What a launch costs".
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_common.cuh"

// Chunk index (in 2 KB chunks) of warp gw's j-th chunk. contig: runs of run_chunks per warp, then the next
// tile's run lies gw_total runs further (as a persistent block's next column block).
__device__ __forceinline__ int64_t chunk_of(bool lockstep, int64_t gw, int64_t gw_total, int64_t j,
                                            int64_t run_chunks) {
    if (lockstep) return j * gw_total + gw;
    const int64_t tile = j / run_chunks, in = j % run_chunks;
    return (tile * gw_total + gw) * run_chunks + in;
}

template <int S>
__global__ void __launch_bounds__(kWarps * 32, 2)
ring_kernel(const uint4 *buf, int64_t chunks_per_warp, int64_t run_chunks, bool lockstep, uint32_t *sink) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t gw_total = int64_t(gridDim.x) * kWarps, gw = int64_t(blockIdx.x) * kWarps + warp;
    unsigned char *ring = smem + warp * S * 2048;
    const unsigned ring_s = unsigned(__cvta_generic_to_shared(ring));
    int64_t filled = 0;
    auto fill = [&]() {
        const uint4 *src = buf + chunk_of(lockstep, gw, gw_total, filled, run_chunks) * 128;
        const unsigned dst = ring_s + unsigned(filled % S) * 2048;
#pragma unroll
        for (int q = 0; q < 4; ++q) cp16(dst + (lane + 32 * q) * 16, src + lane + 32 * q);
        ++filled;
    };
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
        if (filled < chunks_per_warp) fill();
        commit();
    }
    uint32_t acc = 0;
    for (int64_t j = 0; j < chunks_per_warp; ++j) {
        wait_group<S - 2>();
        __syncwarp();
        if (filled < chunks_per_warp) fill();
        commit();
        const uint4 *slot = reinterpret_cast<const uint4 *>(ring + (j % S) * 2048);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const uint4 v = slot[lane + 32 * q];
            acc ^= v.x + v.y + v.z + v.w;
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}


__device__ __forceinline__ uint4 ld_act(const void *p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// The ring of ring_kernel with gemv.cu's consumer, step by step. MODE 1: the chunk's 16-byte pieces
// into the mma fragments (lane g, q: row g pieces 2q, 2q+1, 2 n-tiles), 8 mma against constant x;
// 2: + x loaded from a small (L2 / L1 resident) buffer two chunks ahead, as gemv.cu; 3: + every
// run_chunks chunks (a "tile") the block's warps meet at __syncthreads and reduce acc through shared
// memory (finish_tile's shape, KS = 4 slices).
template <int S, int MODE>
__global__ void __launch_bounds__(kWarps * 32, 2)
gemm_like_kernel(const uint4 *buf, int64_t chunks_per_warp, int64_t run_chunks, const unsigned short *x,
                 uint32_t *sink, uint64_t *times = nullptr) {
    uint64_t t_start = 0, t_first = 0;
    if (times) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_start));
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float red[4 * 16 * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int64_t gw_total = int64_t(gridDim.x) * kWarps, gw = int64_t(blockIdx.x) * kWarps + warp;
    unsigned char *ring = smem + warp * S * 2048;
    const unsigned ring_s = unsigned(__cvta_generic_to_shared(ring));
    auto off = [](int r, int part) { return r * 128 + ((part ^ (r & 7)) << 4); };
    int64_t filled = 0;
    auto fill = [&]() {
        const uint4 *src = buf + chunk_of(false, gw, gw_total, filled, run_chunks) * 128;
        const unsigned dst = ring_s + unsigned(filled % S) * 2048;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int p = lane + 32 * k;
            cp16(dst + off(p >> 3, p & 7), src + p);
        }
        ++filled;
    };
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
        if (filled < chunks_per_warp) fill();
        commit();
    }
    float acc[2][4] = {};
    uint32_t xs[2][2][8];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) xs[a][r][e] = 0x3c003c00u + e + r + a;
    int64_t xj = 0;
    auto load_x = [&](uint32_t out[2][8]) {
        const int64_t c0 = (xj % 64) * 64;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const unsigned short *row = x + (r ? 0 : 0) * 4096;  // decode: every row reads row 0
            const uint4 v0 = ld_act(row + c0 + q * 16), v1 = ld_act(row + c0 + q * 16 + 8);
            out[r][0] = v0.x, out[r][1] = v0.y, out[r][2] = v0.z, out[r][3] = v0.w;
            out[r][4] = v1.x, out[r][5] = v1.y, out[r][6] = v1.z, out[r][7] = v1.w;
        }
        ++xj;
    };
    if (MODE >= 2) {
        load_x(xs[0]);
        load_x(xs[1]);
    }
    for (int64_t j = 0; j < chunks_per_warp; ++j) {
        wait_group<S - 2>();
        __syncwarp();
        if (times && j == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_first));
        if (filled < chunks_per_warp) fill();
        commit();
        const unsigned char *slot = ring + (j % S) * 2048;
        uint32_t wb[2][8];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int row = nt * 8 + g;
            const uint4 v0 = *reinterpret_cast<const uint4 *>(slot + off(row, 2 * q));
            const uint4 v1 = *reinterpret_cast<const uint4 *>(slot + off(row, 2 * q + 1));
            wb[nt][0] = v0.x, wb[nt][1] = v0.y, wb[nt][2] = v0.z, wb[nt][3] = v0.w;
            wb[nt][4] = v1.x, wb[nt][5] = v1.y, wb[nt][6] = v1.z, wb[nt][7] = v1.w;
        }
        uint32_t nx[2][8] = {};
        if (MODE >= 2) load_x(nx);
#pragma unroll
        for (int st = 0; st < 4; ++st)
#pragma unroll
            for (int t = 0; t < 2; ++t)
                mma16816(acc[t], xs[0][0][2 * st], xs[0][1][2 * st], xs[0][0][2 * st + 1], xs[0][1][2 * st + 1],
                         wb[t][2 * st], wb[t][2 * st + 1]);
        if (MODE >= 2) {
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int e = 0; e < 8; ++e) xs[0][r][e] = xs[1][r][e], xs[1][r][e] = nx[r][e];
        }
        if (MODE >= 3 && (j + 1) % run_chunks == 0) {  // a tile's end: finish_tile's reduce
            const int slice = warp % 4, group = warp / 4;
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const int cc = group * 16 + t * 8 + 2 * q;
                red[(slice * 16 + g) * 32 + cc] = acc[t][0];
                red[(slice * 16 + g) * 32 + cc + 1] = acc[t][1];
                red[(slice * 16 + g + 8) * 32 + cc] = acc[t][2];
                red[(slice * 16 + g + 8) * 32 + cc + 1] = acc[t][3];
            }
            __syncthreads();
            float v = 0.f;
            for (int i = threadIdx.x; i < 16 * 32; i += 256) v += red[i] + red[512 + i] + red[1024 + i] + red[1536 + i];
            if (v == 1234.5f) sink[1] = 1;
            __syncthreads();
#pragma unroll
            for (int t = 0; t < 2; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
        }
    }
    if (acc[0][0] + acc[1][3] == 1234.5f) sink[0] = 1;
    if (times && (threadIdx.x & 31) == 0) {
        uint64_t t_end;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_end));
        const int64_t w = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        times[4 * w] = t_start, times[4 * w + 1] = t_first, times[4 * w + 2] = t_end, times[4 * w + 3] = smid;
    }
}

template <int S>
__global__ void __launch_bounds__(kWarps * 32, 2)
bulk_kernel(const unsigned char *buf, int64_t copies_per_warp, int64_t copy_bytes, uint32_t *sink) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(8) uint64_t bars[kWarps * S];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t gw = int64_t(blockIdx.x) * kWarps + warp;
    unsigned char *ring = smem + size_t(warp) * S * copy_bytes;
    uint64_t *bar = bars + warp * S;
    if (lane == 0)
        for (int i = 0; i < S; ++i)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(unsigned(__cvta_generic_to_shared(bar + i))));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncwarp();
    const unsigned char *base = buf + gw * copies_per_warp * copy_bytes;
    int64_t filled = 0;
    auto fill = [&]() {
        if (lane == 0) {
            const unsigned b = unsigned(__cvta_generic_to_shared(bar + filled % S));
            const unsigned d = unsigned(__cvta_generic_to_shared(ring + (filled % S) * copy_bytes));
            asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(b),
                         "r"(unsigned(copy_bytes))
                         : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(d),
                         "l"(base + filled * copy_bytes), "r"(unsigned(copy_bytes)), "r"(b)
                         : "memory");
        }
        ++filled;
    };
    for (int i = 0; i < S - 1; ++i)
        if (filled < copies_per_warp) fill();
    uint32_t acc = 0;
    for (int64_t j = 0; j < copies_per_warp; ++j) {
        const unsigned b = unsigned(__cvta_generic_to_shared(bar + j % S)), parity = unsigned(j / S) & 1u;
        asm volatile(
            "{\n.reg .pred p;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}\n" ::"r"(b),
            "r"(parity)
            : "memory");
        __syncwarp();
        if (filled < copies_per_warp) fill();
        const uint4 *slot = reinterpret_cast<const uint4 *>(ring + (j % S) * copy_bytes);
        for (int64_t q = lane; q < copy_bytes / 16; q += 32) {
            const uint4 v = slot[q];
            acc ^= v.x + v.y + v.z + v.w;
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void ldg_kernel(const uint4 *buf, int64_t n16, uint32_t *sink) {
    uint32_t acc = 0;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n16; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = __ldcs(buf + i + u * stride);
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x + v[u].y + v[u].z + v[u].w;
    }
    for (; i < n16; i += stride) {
        const uint4 v = __ldcs(buf + i);
        acc ^= v.x + v.y + v.z + v.w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

int main() {
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int64_t bytes = int64_t(4) << 30;
    unsigned char *buf = nullptr, *dst = nullptr;
    uint32_t *sink = nullptr;
    CHECK(cudaMalloc(&buf, bytes));
    CHECK(cudaMalloc(&dst, bytes));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMemset(buf, 0x3c, bytes));
    auto report = [&](const char *name, float ms, double moved) {
        std::printf("%-44s %8.3f ms  %6.3f TB/s\n", name, ms, moved / (ms * 1e-3) / 1e12);
    };
    report("memcpy D2D (read + write)", median_ms([&] { CHECK(cudaMemcpyAsync(dst, buf, bytes, cudaMemcpyDeviceToDevice)); }),
           2.0 * bytes);
    CHECK(cudaFree(dst));
    for (int grid_mult : {2}) {
        const int blocks = sms * grid_mult;
        const int64_t warps = int64_t(blocks) * kWarps;
        const int64_t chunks = bytes / 2048, per_warp = chunks / warps;
        const double moved = double(per_warp * warps * 2048);
        auto ring = [&](auto s_const, int64_t run_chunks, bool lockstep) {
            constexpr int S = decltype(s_const)::value;
            const size_t smem = size_t(kWarps) * S * 2048;
            CHECK(cudaFuncSetAttribute(ring_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
            int64_t pw = per_warp - per_warp % run_chunks;
            return std::make_pair(median_ms([&] {
                ring_kernel<S><<<blocks, kWarps * 32, smem>>>(reinterpret_cast<const uint4 *>(buf), pw, run_chunks,
                                                              lockstep, sink);
            }), double(pw * warps * 2048));
        };
        char name[96];
        for (int64_t run : {16, 64, 1 << 20}) {
            auto r = ring(std::integral_constant<int, 7>{}, std::min<int64_t>(run, per_warp), false);
            std::snprintf(name, sizeof name, "ring-contig S=7, runs of %lld KB", (long long)std::min<int64_t>(run, per_warp) * 2);
            report(name, r.first, r.second);
        }
        {
            auto r = ring(std::integral_constant<int, 7>{}, 16, true);
            report("ring-lockstep S=7", r.first, r.second);
            r = ring(std::integral_constant<int, 4>{}, 16, true);
            report("ring-lockstep S=4", r.first, r.second);
            r = ring(std::integral_constant<int, 4>{}, 16, false);
            report("ring-contig S=4, runs of 32 KB", r.first, r.second);
        }
        unsigned short *xbuf = nullptr;
        CHECK(cudaMalloc(&xbuf, 16 * 4096 * 2));
        CHECK(cudaMemset(xbuf, 0x3c, 16 * 4096 * 2));
        auto gemm_like = [&](auto s_const, auto mode_const, int64_t run_chunks) {
            constexpr int S = decltype(s_const)::value, MODE = decltype(mode_const)::value;
            const size_t smem = size_t(kWarps) * S * 2048;
            auto k = gemm_like_kernel<S, MODE>;
            CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
            const int64_t pw = per_warp - per_warp % run_chunks;
            const float ms = median_ms([&] {
                k<<<blocks, kWarps * 32, smem>>>(reinterpret_cast<const uint4 *>(buf), pw, run_chunks, xbuf, sink, nullptr);
            });
            std::snprintf(name, sizeof name, "gemm-like S=%d mode %d, tiles of %lld chunks", S, MODE, (long long)run_chunks);
            report(name, ms, double(pw * warps * 2048));
        };
        using std::integral_constant;
        gemm_like(integral_constant<int, 7>{}, integral_constant<int, 1>{}, 16);
        gemm_like(integral_constant<int, 7>{}, integral_constant<int, 2>{}, 16);
        gemm_like(integral_constant<int, 7>{}, integral_constant<int, 3>{}, 16);
        gemm_like(integral_constant<int, 6>{}, integral_constant<int, 3>{}, 16);
        gemm_like(integral_constant<int, 7>{}, integral_constant<int, 3>{}, 64);
        // One launch per weight-sized read (as a step's GEMMs), at rotating offsets of the buffer: how much of a
        // short launch's time is ramp and tail. S = 6 with the reduce buffer (2 blocks per SM), 16-chunk tiles.
        for (int64_t mb : {12, 25, 50, 100, 200, 400}) {
            constexpr int S = 6;
            const size_t smem = size_t(kWarps) * S * 2048;
            auto k = gemm_like_kernel<S, 3>;
            CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
            const int64_t pw = std::max<int64_t>(16, (mb << 20) / 2048 / warps / 16 * 16);
            const int64_t launch_bytes = pw * warps * 2048, slots = bytes / launch_bytes;
            int i = 0;
            const float ms = median_ms([&] {
                const uint4 *b = reinterpret_cast<const uint4 *>(buf + (i++ % slots) * launch_bytes);
                k<<<blocks, kWarps * 32, smem>>>(b, pw, 16, xbuf, sink, nullptr);
            }, 200);
            std::snprintf(name, sizeof name, "one launch of %.1f MB (%lld chunks per warp)", launch_bytes / 1048576.0,
                          (long long)pw);
            report(name, ms, double(launch_bytes));
            if (mb == 200 || mb == 50) {  // where a launch's time goes: per warp start, first chunk, end
                uint64_t *times = nullptr;
                CHECK(cudaMalloc(&times, size_t(warps) * 4 * 8));
                for (int rep = 0; rep < 3; ++rep) {
                    k<<<blocks, kWarps * 32, smem>>>(reinterpret_cast<const uint4 *>(buf + (rep % slots) * launch_bytes), pw,
                                                     16, xbuf, sink, times);
                    CHECK(cudaDeviceSynchronize());
                }
                std::vector<uint64_t> h(size_t(warps) * 4);
                CHECK(cudaMemcpy(h.data(), times, h.size() * 8, cudaMemcpyDeviceToHost));
                CHECK(cudaFree(times));
                uint64_t t0 = UINT64_MAX;
                for (int64_t w = 0; w < warps; ++w) t0 = std::min(t0, h[4 * w]);
                std::vector<double> st, fi, en;
                for (int64_t w = 0; w < warps; ++w)
                    st.push_back((h[4 * w] - t0) / 1e3), fi.push_back((h[4 * w + 1] - t0) / 1e3),
                        en.push_back((h[4 * w + 2] - t0) / 1e3);
                auto q = [](std::vector<double> v, double f) {
                    std::sort(v.begin(), v.end());
                    return v[size_t(f * (v.size() - 1))];
                };
                std::printf("  us from the first warp's start: start p0/p50/p100 %.2f %.2f %.2f | first chunk %.2f %.2f %.2f"
                            " | end p0 %.2f p10 %.2f p50 %.2f p90 %.2f p100 %.2f\n",
                            q(st, 0), q(st, .5), q(st, 1), q(fi, 0), q(fi, .5), q(fi, 1), q(en, 0), q(en, .1), q(en, .5),
                            q(en, .9), q(en, 1));
                // per SM: mean end of its warps, spread across SMs
                std::vector<double> sm_end(256, 0), sm_n(256, 0);
                for (int64_t w = 0; w < warps; ++w) sm_end[h[4 * w + 3]] += en[w], sm_n[h[4 * w + 3]] += 1;
                std::vector<double> ends;
                for (int i = 0; i < 256; ++i)
                    if (sm_n[i] > 0) ends.push_back(sm_end[i] / sm_n[i]);
                std::printf("  per-SM mean end: p0 %.2f p50 %.2f p100 %.2f over %zu SMs\n", q(ends, 0), q(ends, .5),
                            q(ends, 1), ends.size());
            }
        }
        auto bulk = [&](auto s_const, int64_t ch) {
            constexpr int S = decltype(s_const)::value;
            const size_t smem = size_t(kWarps) * S * ch;
            CHECK(cudaFuncSetAttribute(bulk_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
            const int64_t copies = bytes / ch / warps;
            const float ms = median_ms([&] { bulk_kernel<S><<<blocks, kWarps * 32, smem>>>(buf, copies, ch, sink); });
            std::snprintf(name, sizeof name, "bulk-contig S=%d, %lld B per copy (%zu KB ring/block)", S, (long long)ch,
                          smem / 1024);
            report(name, ms, double(copies * warps * ch));
        };
        bulk(std::integral_constant<int, 7>{}, 2048);
        bulk(std::integral_constant<int, 3>{}, 4096);
        bulk(std::integral_constant<int, 6>{}, 4096);  // 192 KB: one block per SM
        bulk(std::integral_constant<int, 3>{}, 8192);  // 192 KB: one block per SM
    }
    for (int bpsm : {4, 8}) {
        const int64_t n16 = bytes / 16;
        const float ms = median_ms([&] { ldg_kernel<<<sms * bpsm, 256>>>(reinterpret_cast<const uint4 *>(buf), n16, sink); });
        char name[64];
        std::snprintf(name, sizeof name, "ldg x8 in flight, %d blocks/SM", bpsm);
        report(name, ms, double(bytes));
    }
    CHECK(cudaDeviceSynchronize());
    std::printf("done\n");
    return 0;
}
