// gemm_wide.cu: the wide GEMM, y[m, N] = x[m, K] . w[N, K]^T for calls of many rows (a prefill
// chunk), where each weight byte feeds dozens of rows and the tensor cores, not the weight stream,
// set the pace. The small-M family (gemv.cu) re-reads the weights per 16-row tile and spends its
// instructions on streaming; this kernel spends them on mma.
//
// 64 x 128 output tiles per block of 8 warps (2 x 4 warps of 32 x 32), k in steps of 64 through a
// ring of kWideStages x and w tiles in shared memory, filled with cp.async; each tile row is 128
// bytes whose 16-byte pieces are XOR-swizzled by row (piece p of row r at p ^ (r % 8)), so the
// ldmatrix.x4 reads of 8 rows at one k hit 8 different bank groups. mma.sync m16n8k16, bf16 in, fp32
// accumulate. The row tiles vary fastest in the grid, so a column block's row tiles run side by
// side and read its weights from DRAM once, the rest from L2. Weights row-major or tiled
// (backend.hpp's 16 x 64 tiles: a 64-wide k step of a weight row is one 128-byte tile row).
//
// Its sums run in another order than the small-M kernels', so a row computed here differs in the
// last bits from the same row in a verify block or a decode step: callers ask for it only where no
// narrower call must agree with these rows (GemmRows::Wide, the target's prefill chunks).
#include <algorithm>

#include "ops.cuh"

namespace dflash {
namespace cuda {
namespace {

constexpr int kBM = 64, kBN = 128, kBK = 64;  // block tile; kBK = kTileCols: one tile row per k step
constexpr int kWideStages = 4;
constexpr int kWideThreads = 256;             // 8 warps: 2 (rows) x 4 (columns) of 32 x 32
constexpr int kXBytes = kBM * kBK * 2;        // one x tile: 64 rows of 128 bytes
constexpr int kWBytes = kBN * kBK * 2;        // one w tile: 128 rows of 128 bytes
constexpr int kWideStageBytes = kXBytes + kWBytes;
constexpr size_t kWideSmem = size_t(kWideStages) * kWideStageBytes;  // 96 KB: 2 blocks per SM on sm_90 (1 below)
static_assert(kBK == kTileCols, "a k step of a tiled weight row is one tile row");
static_assert(kBM * 64 * 4 <= kWideSmem, "the SwiGLU exchange fits in the ring");

// Byte offset of 16-byte piece p (k = 8p .. 8p + 7) of row r in a tile of 128-byte rows.
__device__ __forceinline__ uint32_t swizzled(int r, int p) { return uint32_t(r * 128 + ((p ^ (r & 7)) << 4)); }

// SWIGLU: w is the fused [gate; up] weight (N = 2 * pair); a block's 128 weight rows are gate rows
// [64 c, 64 c + 64) and the same up rows (pair later), and it stores silu(gate) * up for its 64
// columns, each rounded to bf16 first (as the small-M kernels and gemm + swiglu round them).
// Needs x 16-byte aligned with ldx % 8 == 0 and K % 8 == 0 (16-byte pieces wholly inside or past
// K); row-major w 16-byte aligned.
template <bool TILED, bool SWIGLU>
__global__ void __launch_bounds__(kWideThreads, 2)
gemm_wide_kernel(const bf16 *x, int64_t M, int64_t ldx, const bf16 *__restrict__ w, int64_t N, int64_t K,
                 bf16 *y, int64_t ldy, int64_t pair) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;  // this warp's rows wm * 32 .., columns wn * 32 ..
    const int64_t m0 = int64_t(blockIdx.x) * kBM, cb = blockIdx.y;
    const int64_t chunks = (K + kBK - 1) / kBK;
    const uint32_t ring = uint32_t(__cvta_generic_to_shared(smem));

    // This thread's pieces: x pieces tid and tid + 256 (64 rows x 8), w pieces tid + 256 j (128 x 8).
    const bf16 *xp[2];
    bool x_ok[2];
    uint32_t x_dst[2];
    int x_k[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int i = tid + kWideThreads * j, r = i >> 3, p = i & 7;
        x_ok[j] = m0 + r < M;
        xp[j] = x + (x_ok[j] ? (m0 + r) * ldx : 0) + p * 8;
        x_dst[j] = swizzled(r, p);
        x_k[j] = p * 8;
    }
    const bf16 *wp[4];
    bool w_ok[4];
    uint32_t w_dst[4];
    int w_k[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = tid + kWideThreads * j, r = i >> 3, p = i & 7;
        int64_t n;
        if constexpr (SWIGLU) {
            const int64_t c = cb * (kBN / 2) + (r & (kBN / 2 - 1));
            w_ok[j] = c < pair;
            n = r < kBN / 2 ? c : pair + c;
        } else {
            n = cb * kBN + r;
            w_ok[j] = n < N;
        }
        if (!w_ok[j]) n = 0;
        wp[j] = TILED ? w + (n / kTileRows) * chunks * (kTileRows * kTileCols) + (n % kTileRows) * kTileCols + p * 8
                      : w + n * K + p * 8;
        w_dst[j] = swizzled(r, p);
        w_k[j] = p * 8;
    }
    // k step c into ring slot c % kWideStages
    auto load_w = [&](int64_t c) {
        unsigned char *slot = smem + (c % kWideStages) * kWideStageBytes + kXBytes;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const bool ok = w_ok[j] && c * kBK + w_k[j] < K;
            const bf16 *src = wp[j] + (TILED ? c * (kTileRows * kTileCols) : c * kBK);
            cp_async16(slot + w_dst[j], ok ? src : w, ok);
        }
    };
    auto load_x = [&](int64_t c) {
        unsigned char *slot = smem + (c % kWideStages) * kWideStageBytes;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const bool ok = x_ok[j] && c * kBK + x_k[j] < K;
            cp_async16(slot + x_dst[j], ok ? xp[j] + c * kBK : x, ok);
        }
    };

    // The weights never change: their first steps stream in while the kernels before this one finish
    // (programmatic dependent launch); x waits. Group s holds x step s (and group 0 every early w step).
#pragma unroll
    for (int s = 0; s < kWideStages - 1; ++s)
        if (s < chunks) load_w(s);
    pdl_wait();
#pragma unroll
    for (int s = 0; s < kWideStages - 1; ++s) {
        if (s < chunks) load_x(s);
        cp_async_commit();
    }

    float acc[2][4][4] = {};  // [m16 tile][n8 tile][fragment]
    for (int64_t c = 0; c < chunks; ++c) {
        cp_async_wait<kWideStages - 2>();  // this thread's pieces of step c have landed
        __syncthreads();                   // ... and everyone's; step c - 1's slot is free
        if (c + kWideStages - 1 < chunks) {
            load_w(c + kWideStages - 1);
            load_x(c + kWideStages - 1);
        }
        cp_async_commit();
        const uint32_t xs = ring + uint32_t((c % kWideStages) * kWideStageBytes), ws = xs + kXBytes;
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
            uint32_t a[2][4], b[4][2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)  // matrices: rows 0-7 / 8-15 at k 0-7, then at k 8-15
                ldmatrix_x4(xs + swizzled(wm * 32 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)), a[mt][0],
                            a[mt][1], a[mt][2], a[mt][3]);
#pragma unroll
            for (int np = 0; np < 2; ++np)  // matrices: n 0-7 at k 0-7 / 8-15, then n 8-15
                ldmatrix_x4(ws + swizzled(wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                          kk * 2 + ((lane >> 3) & 1)),
                            b[2 * np][0], b[2 * np][1], b[2 * np + 1][0], b[2 * np + 1][1]);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
                    mma_bf16_16816(acc[mt][nt], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[nt][0], b[nt][1]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: SWIGLU exchanges through it
    pdl_launch_dependents();  // a many-wave grid: dependents launched earlier would take its slots

    const int g = lane >> 2, q = lane & 3;
    if constexpr (SWIGLU) {
        // The up warps (wn 2, 3) leave their sums in shared memory; the gate warps (wn 0, 1) finish.
        float *up = reinterpret_cast<float *>(smem);  // [64 rows][64 columns]
        if (wn >= 2) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = wm * 32 + mt * 16 + g + 8 * h, cc = (wn - 2) * 32 + nt * 8 + 2 * q;
                        up[r * 64 + cc] = acc[mt][nt][2 * h];
                        up[r * 64 + cc + 1] = acc[mt][nt][2 * h + 1];
                    }
        }
        __syncthreads();
        if (wn < 2) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int h = 0; h < 4; ++h) {
                        const int r = wm * 32 + mt * 16 + g + 8 * (h >> 1), cc = wn * 32 + nt * 8 + 2 * q + (h & 1);
                        const int64_t m = m0 + r, n = cb * (kBN / 2) + cc;
                        if (m < M && n < pair)
                            y[m * ldy + n] = to_bf16(swiglu_value(to_float(to_bf16(acc[mt][nt][h])),
                                                                  to_float(to_bf16(up[r * 64 + cc]))));
                    }
        }
    } else {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int h = 0; h < 4; ++h) {
                    const int64_t m = m0 + wm * 32 + mt * 16 + g + 8 * (h >> 1);
                    const int64_t n = cb * kBN + wn * 32 + nt * 8 + 2 * q + (h & 1);
                    if (m < M && n < N) y[m * ldy + n] = to_bf16(acc[mt][nt][h]);
                }
    }
}

template <bool TILED, bool SWIGLU>
void launch_wide(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, int64_t N, int64_t K, bf16 *y,
                 int64_t ldy, int64_t pair, cudaStream_t s) {
    const int64_t col_blocks = SWIGLU ? (pair + kBN / 2 - 1) / (kBN / 2) : (N + kBN - 1) / kBN;
    const int64_t row_tiles = (M + kBM - 1) / kBM;
    if (col_blocks > 65535 || row_tiles >= int64_t(1) << 31)
        fail(DFLASH_STATUS_NOT_SUPPORTED, "gemm (wide): ", row_tiles, " x ", col_blocks, " tiles for M = ", M,
             ", N = ", N);
    auto *kernel = gemm_wide_kernel<TILED, SWIGLU>;
    // Idempotent and not a stream operation: set before each (uncaptured, few) launch, on any device.
    DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kWideSmem)));
    launch(kernel, dim3(unsigned(row_tiles), unsigned(col_blocks)), kWideThreads, kWideSmem, s, x, M, ldx, w, N, K,
           y, ldy, pair);
}

}  // namespace

bool gemm_wide_fits(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t K) {
    return M >= kWideMinRows && K % 8 == 0 && ldx % 8 == 0 && aligned16(x) && (w_tiled || aligned16(w));
}

void gemm_wide(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t N, int64_t K, bf16 *y,
               int64_t ldy, cudaStream_t s) {
    if (M == 0 || N == 0) return;
    if (w_tiled)
        launch_wide<true, false>(x, M, ldx, w, N, K, y, ldy, 0, s);
    else
        launch_wide<false, false>(x, M, ldx, w, N, K, y, ldy, 0, s);
}

void gemm_wide_swiglu(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t inter,
                      int64_t K, bf16 *out, int64_t ldo, cudaStream_t s) {
    if (M == 0 || inter == 0) return;
    if (w_tiled)
        launch_wide<true, true>(x, M, ldx, w, 2 * inter, K, out, ldo, inter, s);
    else
        launch_wide<false, true>(x, M, ldx, w, 2 * inter, K, out, ldo, inter, s);
}

}  // namespace cuda
}  // namespace dflash
