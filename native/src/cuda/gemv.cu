// gemv.cu: the small-M GEMM family (M = block rows x batch), y[m, N] = x[m, K] . w[N, K]^T.
//
// At batch 1 every step is bound by streaming the weights once, so the kernel is shaped around
// the weight stream: tensor-core mma.sync m16n8k16 (bf16 in, fp32 accumulate) over a 16-row tile
// of x, each lane loading 2 x 16 bytes of a weight row per 64-wide k chunk. M = 1..16 is one
// tile (rows past M are zeros), so the weights are read once per step whatever the block width.
//
// The k permutation: mma's k slots are a free relabelling of the sum, so lane (g = lane / 4,
// q = lane % 4) loads k0 + q*16 .. +15 of its row (16 contiguous bf16: two 16-byte loads) and
// feeds them to four mma steps; x is loaded with the same relabelling.
//
// Batch invariance (DESIGN §5): an output element is the same sequence of mma steps over the
// same k chunks, then the same fixed-order sum over the warps that split K, whatever M is and
// whichever rows share its tile (mma computes each row independently). How K is split (ks) and
// how many columns a warp owns (nt) depend only on N, K and the device's SM count. So a row
// verified among 16 gives the same bits as the same row decoded alone.
//
// Epilogues: bf16 store (GEMM), fp32 logits with multiplier/softcap, or a fused argmax that
// never writes logits: per-block (value, index) partial maxima, then a small reduce kernel.
#include <algorithm>

#include "ops.cuh"

namespace dflash {
namespace cuda {
namespace {

constexpr int kWarps = 8;     // per block: kWarps / ks column groups x ks k-slices
constexpr int kTileM = 16;    // rows per mma tile
constexpr int kChunk = 64;    // k per lane-quad step (4 mma k16 steps)

enum class Epilogue { Store, Logits, Argmax };

struct ArgmaxPartial {
    float value;
    int32_t index;
};

__device__ __forceinline__ float finish_logit(float v, float multiplier, float softcap) {
    v *= multiplier;
    if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
    return v;
}

// The 16 bf16 lane-quad member q loads of row `row` in the 64-wide chunk at c0 (k = c0 + q*16
// .. +15), as 8 words; zeros past K or for a row out of range. x and w use the same function, so
// both see the same relabelling of k. (Measured on the H200: this layout with 2 chunks in flight
// beat a split-halves layout (64 contiguous bytes per quad load) and 4 chunks in flight, by 1-5%.)
__device__ __forceinline__ void load16(const bf16 *__restrict__ base, int64_t ld, int64_t row,
                                       bool row_ok, int64_t c0, int q, int64_t K, bool vectorized,
                                       uint32_t out[8]) {
    const int64_t k_lo = c0 + q * 16, k_hi = k_lo + 8;
    if (row_ok && vectorized && c0 + kChunk <= K) {
        const uint4 v0 = __ldg(reinterpret_cast<const uint4 *>(base + row * ld + k_lo));
        const uint4 v1 = __ldg(reinterpret_cast<const uint4 *>(base + row * ld + k_hi));
        out[0] = v0.x, out[1] = v0.y, out[2] = v0.z, out[3] = v0.w;
        out[4] = v1.x, out[5] = v1.y, out[6] = v1.z, out[7] = v1.w;
        return;
    }
    const unsigned short *p = reinterpret_cast<const unsigned short *>(base + row * ld);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int64_t k0 = (i < 4 ? k_lo : k_hi) + 2 * (i & 3);
        const uint32_t lo = row_ok && k0 < K ? p[k0] : 0u;
        const uint32_t hi = row_ok && k0 + 1 < K ? p[k0 + 1] : 0u;
        out[i] = lo | (hi << 16);
    }
}

// x: [M, ldx] bf16; w: [N, K] bf16. grid = (column blocks, ceil(M / 16)); block = kWarps warps:
// warp = group * KS + slice; a group owns NT*8 columns; a slice owns a contiguous run of chunks.
template <int NT, int KS, Epilogue E>
__global__ void __launch_bounds__(kWarps * 32)
gemm_mma_kernel(const bf16 *__restrict__ x, int64_t M, int64_t ldx, const bf16 *__restrict__ w,
                int64_t N, int64_t K, bool vectorized, bf16 *y, int64_t ldy, float multiplier,
                float softcap, float *logits_out, ArgmaxPartial *partial) {
    constexpr int kGroups = kWarps / KS;
    constexpr int kCols = NT * 8;                 // per group
    constexpr int kBlockCols = kGroups * kCols;
    __shared__ float red[KS][kTileM][kBlockCols];  // per-slice partial sums (fixed-order reduce)

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = warp / KS, slice = warp % KS;
    const int g = lane >> 2, q = lane & 3;
    const int64_t m0 = int64_t(blockIdx.y) * kTileM;
    const int64_t col0 = int64_t(blockIdx.x) * kBlockCols + group * kCols;

    const int64_t chunks = (K + kChunk - 1) / kChunk;
    const int64_t per_slice = (chunks + KS - 1) / KS;
    const int64_t c_begin = slice * per_slice, c_end = min(chunks, c_begin + per_slice);

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;

    const bool row0_ok = m0 + g < M, row1_ok = m0 + g + 8 < M;
#pragma unroll 2
    for (int64_t c = c_begin; c < c_end; ++c) {
        const int64_t c0 = c * kChunk;
        uint32_t wb[NT][8];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int64_t n = col0 + t * 8 + g;
            load16(w, K, n, n < N, c0, q, K, vectorized, wb[t]);
        }
        uint32_t x0[8], x1[8];
        load16(x, ldx, m0 + g, row0_ok, c0, q, K, vectorized, x0);
        load16(x, ldx, m0 + g + 8, row1_ok, c0, q, K, vectorized, x1);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const uint32_t a[4] = {x0[2 * s], x1[2 * s], x0[2 * s + 1], x1[2 * s + 1]};
#pragma unroll
            for (int t = 0; t < NT; ++t)
                mma_bf16_16816(acc[t], a[0], a[1], a[2], a[3], wb[t][2 * s], wb[t][2 * s + 1]);
        }
    }

    // c0, c1: row g, columns 2q, 2q+1 of the n-tile; c2, c3: row g + 8.
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int cc = group * kCols + t * 8 + 2 * q;
        red[slice][g][cc] = acc[t][0];
        red[slice][g][cc + 1] = acc[t][1];
        red[slice][g + 8][cc] = acc[t][2];
        red[slice][g + 8][cc + 1] = acc[t][3];
    }
    __syncthreads();

    // Final values: slices summed in order 0..KS-1; red[0] then holds them.
    for (int i = threadIdx.x; i < kTileM * kBlockCols; i += kWarps * 32) {
        const int r = i / kBlockCols, cc = i % kBlockCols;
        float v = red[0][r][cc];
#pragma unroll
        for (int sl = 1; sl < KS; ++sl) v += red[sl][r][cc];
        const int64_t m = m0 + r, n = int64_t(blockIdx.x) * kBlockCols + cc;
        if constexpr (E == Epilogue::Store) {
            if (m < M && n < N) y[m * ldy + n] = to_bf16(v);
        } else if constexpr (E == Epilogue::Logits) {
            if (m < M && n < N) logits_out[m * N + n] = finish_logit(v, multiplier, softcap);
        } else {
            red[0][r][cc] = finish_logit(v, multiplier, softcap);
        }
    }
    if constexpr (E == Epilogue::Argmax) {
        __syncthreads();
        // One warp per row: lanes scan columns lane, lane+32, ... (increasing), then a butterfly
        // that keeps the lowest index on ties (torch.argmax).
        for (int r = warp; r < kTileM; r += kWarps) {
            if (m0 + r >= M) continue;
            ArgmaxPartial b{-INFINITY, INT32_MAX};
            for (int cc = lane; cc < kBlockCols; cc += 32) {
                const int64_t n = int64_t(blockIdx.x) * kBlockCols + cc;
                const float v = red[0][r][cc];
                if (n < N && (v > b.value || b.index == INT32_MAX)) b = {v, int32_t(n)};
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, b.value, o);
                const int32_t oi = __shfl_xor_sync(0xffffffffu, b.index, o);
                if (oi != INT32_MAX &&
                    (b.index == INT32_MAX || ov > b.value || (ov == b.value && oi < b.index)))
                    b = {ov, oi};
            }
            if (lane == 0) partial[(m0 + r) * gridDim.x + blockIdx.x] = b;
        }
    }
}

// partial: [M, blocks]; one block per row; ties keep the lowest index (torch.argmax).
__global__ void argmax_reduce_kernel(const ArgmaxPartial *partial, int64_t blocks, int32_t *tokens) {
    __shared__ ArgmaxPartial best[256];
    const ArgmaxPartial *row = partial + int64_t(blockIdx.x) * blocks;
    ArgmaxPartial b{-INFINITY, INT32_MAX};
    for (int64_t i = threadIdx.x; i < blocks; i += blockDim.x) {  // increasing index per thread
        const ArgmaxPartial c = row[i];
        if (c.index != INT32_MAX && (c.value > b.value || b.index == INT32_MAX)) b = c;
    }
    best[threadIdx.x] = b;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const ArgmaxPartial o = best[threadIdx.x + stride];
            ArgmaxPartial &m = best[threadIdx.x];
            if (o.index != INT32_MAX &&
                (m.index == INT32_MAX || o.value > m.value || (o.value == m.value && o.index < m.index)))
                m = o;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) tokens[blockIdx.x] = best[0].index;
}

int sm_count() {
    static int cached[64] = {};
    int device = 0;
    DFLASH_CUDA_CHECK(cudaGetDevice(&device));
    if (device < 0 || device >= 64) return 132;
    if (cached[device] == 0) {
        int n = 0;
        DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
        cached[device] = n > 0 ? n : 132;
    }
    return cached[device];
}

// The tiling of an [N, K] weight: the widest column groups (nt) and the fewest k slices (ks)
// that still give every SM about two blocks. A function of N, K and the SM count only.
struct Tiling {
    int nt, ks;
    int64_t block_cols() const { return int64_t(kWarps / ks) * nt * 8; }
    unsigned blocks(int64_t N) const { return unsigned((N + block_cols() - 1) / block_cols()); }
};

Tiling tiling(int64_t N, int64_t K) {
    // ~1.75 blocks of 8 warps per SM (measured on the H200: 1 and 3 per SM were 7-30% slower)
    const int64_t want = 7 * int64_t(sm_count()) / 4;
    const int64_t chunks = (K + kChunk - 1) / kChunk;
    for (int nt : {4, 2, 1})
        for (int ks : {1, 2, 4, 8}) {
            if (ks > 1 && chunks < 2 * ks) break;  // slices of under two chunks only add reduce work
            const Tiling t{nt, ks};
            if (t.blocks(N) >= want) return t;
        }
    return Tiling{1, chunks >= 16 ? 8 : 1};
}

template <Epilogue E>
void launch(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, int64_t N, int64_t K, bf16 *y,
            int64_t ldy, float multiplier, float softcap, float *logits_out, ArgmaxPartial *partial,
            cudaStream_t s) {
    const bool vectorized = K % 8 == 0 && ldx % 8 == 0 && aligned16(x) && aligned16(w);
    const Tiling t = tiling(N, K);
    const dim3 grid(t.blocks(N), unsigned((M + kTileM - 1) / kTileM));
    auto go = [&](auto nt, auto ks) {
        constexpr int NT = decltype(nt)::value, KS = decltype(ks)::value;
        gemm_mma_kernel<NT, KS, E><<<grid, kWarps * 32, 0, s>>>(
            x, M, ldx, w, N, K, vectorized, y, ldy, multiplier, softcap, logits_out, partial);
    };
    using std::integral_constant;
    auto by_ks = [&](auto nt) {
        switch (t.ks) {
            case 1: go(nt, integral_constant<int, 1>{}); break;
            case 2: go(nt, integral_constant<int, 2>{}); break;
            case 4: go(nt, integral_constant<int, 4>{}); break;
            default: go(nt, integral_constant<int, 8>{}); break;
        }
    };
    switch (t.nt) {
        case 4: by_ks(integral_constant<int, 4>{}); break;
        case 2: by_ks(integral_constant<int, 2>{}); break;
        default: by_ks(integral_constant<int, 1>{}); break;
    }
    DFLASH_CUDA_LAUNCHED();
}

}  // namespace

void gemm(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, int64_t N, int64_t K, bf16 *y,
          int64_t ldy, cudaStream_t s) {
    if (M == 0 || N == 0) return;
    launch<Epilogue::Store>(x, M, ldx, w, N, K, y, ldy, 1.f, 0.f, nullptr, nullptr, s);
}

void logits(const bf16 *x, int64_t M, const bf16 *w, int64_t V, int64_t K, float multiplier,
            float softcap, float *out, cudaStream_t s) {
    if (M == 0) return;
    launch<Epilogue::Logits>(x, M, K, w, V, K, nullptr, 0, multiplier, softcap, out, nullptr, s);
}

// An upper bound whatever the tiling: every block owns at least 8 columns.
size_t logits_argmax_scratch_bytes(int64_t M, int64_t V) {
    return size_t(M) * size_t((V + 7) / 8) * sizeof(ArgmaxPartial);
}

void logits_argmax(const bf16 *x, int64_t M, const bf16 *w, int64_t V, int64_t K,
                   float multiplier, float softcap, void *partial, int32_t *tokens,
                   cudaStream_t s) {
    if (M == 0) return;
    auto *p = static_cast<ArgmaxPartial *>(partial);
    launch<Epilogue::Argmax>(x, M, K, w, V, K, nullptr, 0, multiplier, softcap, nullptr, p, s);
    argmax_reduce_kernel<<<unsigned(M), 256, 0, s>>>(p, tiling(V, K).blocks(V), tokens);
    DFLASH_CUDA_LAUNCHED();
}

}  // namespace cuda
}  // namespace dflash
