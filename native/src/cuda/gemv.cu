// gemv.cu: the small-M GEMM family (M = block rows x batch), written GEMV-style because at
// batch 1 every step is bound by streaming the weights once.
//
// Layout: a warp owns NPW output columns; each lane walks K in 16-byte chunks (8 bf16) at
// k = lane*8, lane*8 + 256, ... and keeps fp32 partial sums for MT rows; a fixed butterfly
// reduces the lanes. The order in which any output element is summed depends only on K (and on
// whether the 16-byte path applies), never on M, MT or NPW: a row verified among 16 gives the
// same bits as the same row decoded alone (DESIGN §5, batch invariance), which keeps
// speculative output identical to autoregressive output on this backend.
//
// Epilogues: bf16 store (GEMM), fp32 logits with multiplier/softcap, or a fused argmax that
// never writes logits: per-block (value, index) partial maxima, then a small reduce kernel.
#include <algorithm>

#include "ops.cuh"

namespace dflash {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kNpw = 2;  // output columns per warp

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

// x: [M, ldx] bf16; w: [N, K] bf16. grid = (ceil(N / (kWarps*kNpw)), ceil(M / MT)).
template <int MT, Epilogue E>
__global__ void __launch_bounds__(kWarps * 32)
gemv_kernel(const bf16 *__restrict__ x, int64_t M, int64_t ldx, const bf16 *__restrict__ w,
            int64_t N, int64_t K, bool vectorized, bf16 *y, int64_t ldy, float multiplier,
            float softcap, float *logits_out, ArgmaxPartial *partial) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t n0 = (int64_t(blockIdx.x) * kWarps + warp) * kNpw;
    const int64_t m0 = int64_t(blockIdx.y) * MT;
    float acc[MT][kNpw];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < kNpw; ++j) acc[m][j] = 0.f;

    if (vectorized) {
        for (int64_t k = int64_t(lane) * 8; k < K; k += 256) {
            float wv[kNpw][8];
#pragma unroll
            for (int j = 0; j < kNpw; ++j) {
                if (n0 + j < N) {
                    unpack8(__ldg(reinterpret_cast<const uint4 *>(w + (n0 + j) * K + k)), wv[j]);
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) wv[j][e] = 0.f;
                }
            }
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if (m0 + m >= M) break;
                float xv[8];
                unpack8(*reinterpret_cast<const uint4 *>(x + (m0 + m) * ldx + k), xv);
#pragma unroll
                for (int j = 0; j < kNpw; ++j)
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[m][j] = fmaf(xv[e], wv[j][e], acc[m][j]);
            }
        }
    } else {  // any alignment: one element per lane per step
        for (int64_t k = lane; k < K; k += 32) {
            float wv[kNpw];
#pragma unroll
            for (int j = 0; j < kNpw; ++j) wv[j] = n0 + j < N ? to_float(w[(n0 + j) * K + k]) : 0.f;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if (m0 + m >= M) break;
                const float xv = to_float(x[(m0 + m) * ldx + k]);
#pragma unroll
                for (int j = 0; j < kNpw; ++j) acc[m][j] = fmaf(xv, wv[j], acc[m][j]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < kNpw; ++j) acc[m][j] = warp_sum(acc[m][j]);

    if constexpr (E == Epilogue::Store) {
        if (lane == 0)
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < kNpw; ++j)
                    if (m0 + m < M && n0 + j < N) y[(m0 + m) * ldy + n0 + j] = to_bf16(acc[m][j]);
    } else if constexpr (E == Epilogue::Logits) {
        if (lane == 0)
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < kNpw; ++j)
                    if (m0 + m < M && n0 + j < N)
                        logits_out[(m0 + m) * N + n0 + j] = finish_logit(acc[m][j], multiplier, softcap);
    } else {
        __shared__ ArgmaxPartial best[kWarps][MT];
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                ArgmaxPartial b{-INFINITY, INT32_MAX};
#pragma unroll
                for (int j = 0; j < kNpw; ++j) {
                    const float v = finish_logit(acc[m][j], multiplier, softcap);
                    if (n0 + j < N && (v > b.value || b.index == INT32_MAX)) b = {v, int32_t(n0 + j)};
                }
                best[warp][m] = b;
            }
        }
        __syncthreads();
        if (threadIdx.x < MT && m0 + threadIdx.x < M) {
            const int m = threadIdx.x;
            ArgmaxPartial b = best[0][m];
            for (int wi = 1; wi < kWarps; ++wi) {  // columns increase with the warp index
                const ArgmaxPartial c = best[wi][m];
                if (c.index != INT32_MAX && (c.value > b.value || b.index == INT32_MAX)) b = c;
            }
            partial[(m0 + m) * gridDim.x + blockIdx.x] = b;
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

bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <Epilogue E>
void launch(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, int64_t N, int64_t K, bf16 *y,
            int64_t ldy, float multiplier, float softcap, float *logits_out, ArgmaxPartial *partial,
            cudaStream_t s) {
    const bool vectorized = K % 8 == 0 && ldx % 8 == 0 && aligned16(x) && aligned16(w);
    const unsigned col_blocks = unsigned((N + kWarps * kNpw - 1) / (kWarps * kNpw));
    auto go = [&](auto mt) {
        constexpr int MT = decltype(mt)::value;
        const dim3 grid(col_blocks, unsigned((M + MT - 1) / MT));
        gemv_kernel<MT, E><<<grid, kWarps * 32, 0, s>>>(x, M, ldx, w, N, K, vectorized, y, ldy,
                                                        multiplier, softcap, logits_out, partial);
    };
    if (M == 1) go(std::integral_constant<int, 1>{});
    else if (M == 2) go(std::integral_constant<int, 2>{});
    else if (M <= 4) go(std::integral_constant<int, 4>{});
    else go(std::integral_constant<int, 8>{});
    DFLASH_CUDA_LAUNCHED();
}

unsigned column_blocks(int64_t N) { return unsigned((N + kWarps * kNpw - 1) / (kWarps * kNpw)); }

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

size_t logits_argmax_scratch_bytes(int64_t M, int64_t V) {
    return size_t(M) * column_blocks(V) * sizeof(ArgmaxPartial);
}

void logits_argmax(const bf16 *x, int64_t M, const bf16 *w, int64_t V, int64_t K,
                   float multiplier, float softcap, void *partial, int32_t *tokens,
                   cudaStream_t s) {
    if (M == 0) return;
    auto *p = static_cast<ArgmaxPartial *>(partial);
    launch<Epilogue::Argmax>(x, M, K, w, V, K, nullptr, 0, multiplier, softcap, nullptr, p, s);
    argmax_reduce_kernel<<<unsigned(M), 256, 0, s>>>(p, column_blocks(V), tokens);
    DFLASH_CUDA_LAUNCHED();
}

}  // namespace cuda
}  // namespace dflash
