// norm.cu: RMSNorm (HF form x * w / rms(x)) over `groups` vectors of `dim` per row; the per-head
// q_norm / k_norm are the same op with groups = heads. One block per vector, fp32 statistics.
// y may alias x: every thread reads its elements before writing them.
#include <algorithm>
#include <vector>

#include "ops.cuh"

namespace dflash {
namespace cuda {
namespace {

#ifdef DFLASH_PHASE_PROBE
// rms_norm_vec_kernel (gemm_chain_bench --probe; the last launch's blocks stay: the norm before the last layer's
// gate/up): 0 entry, 1 after the wait, 2 the row's sum of squares done (its loads landed), 3 end.
DFLASH_PROBE_TABLE(g_probe_norm);
#endif

constexpr int kThreads = 128;

// x: [rows, ld_x] holding [groups, dim]; w: [dim], or nullptr (ones: x / rms(x)); y: [rows, ld_y]
__global__ void rms_norm_kernel(const bf16 *x, int64_t groups, int64_t dim, int64_t ld_x,
                                const bf16 *w, float eps, bf16 *y, int64_t ld_y) {
    pdl_prologue();
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x / groups, g = blockIdx.x % groups;
    const bf16 *in = x + row * ld_x + g * dim;
    bf16 *out = y + row * ld_y + g * dim;
    float ss = 0.f;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
        const float v = to_float(in[c]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / float(dim) + eps);
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x)
        out[c] = to_bf16((w ? to_float(w[c]) : 1.f) * (to_float(in[c]) * inv));
}

// 8 packed bf16 of x -> bf16(w * (x * inv)), as rms_norm_kernel rounds each element.
__device__ __forceinline__ uint4 normed8(const uint4 &x, const uint4 &w, float inv) {
    float v[8], wf[8];
    unpack8(x, v);
    unpack8(w, wf);
    uint4 o;
    __nv_bfloat162 *oh = reinterpret_cast<__nv_bfloat162 *>(&o);
#pragma unroll
    for (int e = 0; e < 4; ++e)
        oh[e] = __halves2bfloat162(to_bf16(wf[2 * e] * (v[2 * e] * inv)),
                                   to_bf16(wf[2 * e + 1] * (v[2 * e + 1] * inv)));
    return o;
}

// The vector kernels' pieces per thread: a thread holds its x (and w) pieces in registers between the sum of
// squares and the output, so the output needs no second round trip; wider rows take the scalar kernels.
constexpr int kMaxPieces = 2;  // dim <= 1024 threads x 2 x 8 = 16384

// Whether rows of `dim` fit the vector kernels: 16-byte pieces, at most kMaxPieces per thread of 1024.
bool vec_dim(int64_t dim) { return dim % 8 == 0 && dim / 8 <= 1024 * kMaxPieces; }

// The same with 16-byte accesses: dim % 8 == 0, rows 16-byte aligned; blockDim.x = a multiple of
// 32 covering dim / 8 pieces in at most kMaxPieces per thread (most threads own one). Same statistics order
// for every row count. w (a weight, constant) is loaded before the wait for the kernel before.
__global__ void __launch_bounds__(1024)
rms_norm_vec_kernel(const bf16 *x, int64_t groups, int64_t dim, int64_t ld_x, const bf16 *w, float eps, bf16 *y,
                    int64_t ld_y) {
    pdl_launch_dependents();
    DFLASH_PROBE(g_probe_norm, 0);
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x / groups, g = blockIdx.x % groups;
    const uint4 *in = reinterpret_cast<const uint4 *>(x + row * ld_x + g * dim);
    uint4 *out = reinterpret_cast<uint4 *>(y + row * ld_y + g * dim);
    const uint4 *wv = reinterpret_cast<const uint4 *>(w);
    const int pieces = int(dim / 8);
    const uint4 ones = make_uint4(0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u);  // bf16 1.0 x 8
    uint4 wr[kMaxPieces], xv[kMaxPieces];
#pragma unroll
    for (int u = 0; u < kMaxPieces; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        wr[u] = wv && i < pieces ? wv[i] : ones;
    }
    pdl_wait();
    DFLASH_PROBE(g_probe_norm, 1);
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < kMaxPieces; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < pieces) {
            xv[u] = in[i];
            float v[8];
            unpack8(xv[u], v);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += v[e] * v[e];
        }
    }
    ss = block_sum(ss, scratch);
    DFLASH_PROBE(g_probe_norm, 2);
    const float inv = rsqrtf(ss / float(dim) + eps);
#pragma unroll
    for (int u = 0; u < kMaxPieces; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < pieces) out[i] = normed8(xv[u], wr[u], inv);
    }
    DFLASH_PROBE(g_probe_norm, 3);
}

// x[row] += res[row] (each sum rounded to bf16 and stored), then y[row] = norm(x[row]) * w, one
// block per row, 16-byte pieces held in registers (at most kMaxPieces per thread), so y may alias res; w is
// loaded before the wait.
__global__ void __launch_bounds__(1024)
add_rms_norm_kernel(bf16 *x, const bf16 *res, int64_t dim, const bf16 *w, float eps, bf16 *y) {
    pdl_launch_dependents();
    __shared__ float scratch[32];
    uint4 *xr = reinterpret_cast<uint4 *>(x + int64_t(blockIdx.x) * dim);
    const uint4 *rr = reinterpret_cast<const uint4 *>(res + int64_t(blockIdx.x) * dim);
    uint4 *out = reinterpret_cast<uint4 *>(y + int64_t(blockIdx.x) * dim);
    const uint4 *wv = reinterpret_cast<const uint4 *>(w);
    const int pieces = int(dim / 8);
    uint4 wr[kMaxPieces], sum[kMaxPieces];
#pragma unroll
    for (int u = 0; u < kMaxPieces; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < pieces) wr[u] = wv[i];
    }
    pdl_wait();
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < kMaxPieces; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < pieces) {
            float a[8], b[8];
            unpack8(xr[i], a);
            unpack8(rr[i], b);
            __nv_bfloat162 *oh = reinterpret_cast<__nv_bfloat162 *>(&sum[u]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                oh[e] = __halves2bfloat162(to_bf16(a[2 * e] + b[2 * e]), to_bf16(a[2 * e + 1] + b[2 * e + 1]));
                const float2 f = __bfloat1622float2(oh[e]);
                ss += f.x * f.x;
                ss += f.y * f.y;
            }
            xr[i] = sum[u];
        }
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / float(dim) + eps);
#pragma unroll
    for (int u = 0; u < kMaxPieces; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < pieces) out[i] = normed8(sum[u], wr[u], inv);
    }
}

// One thread per (row, part of 16 columns), the squares summed in column order.
__global__ void row_sq_parts_kernel(const bf16 *y, int64_t M, int64_t N, int64_t ldy, float *ss_out) {
    pdl_prologue();
    const int64_t parts = ss_parts(N);
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < M * parts;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t m = i / parts, n0 = i % parts * 16;
        float sq = 0.f;
        for (int64_t n = n0; n < N && n < n0 + 16; ++n) {
            const float v = to_float(y[m * ldy + n]);
            sq += v * v;
        }
        ss_out[i] = sq;
    }
}

}  // namespace

void row_sq_parts(const bf16 *y, int64_t M, int64_t N, int64_t ldy, float *ss_out, cudaStream_t s) {
    const int64_t n = M * ss_parts(N);
    if (n == 0) return;
    launch(row_sq_parts_kernel, unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 4096)), kThreads, 0, s, y,
           M, N, ldy, ss_out);
}

void rms_norm(const bf16 *x, int64_t rows, int64_t groups, int64_t dim, int64_t ld_x,
              const bf16 *w, float eps, bf16 *y, int64_t ld_y, cudaStream_t s) {
    if (rows * groups == 0) return;
    if (rows * groups > INT32_MAX) fail(DFLASH_STATUS_INTERNAL, "rms_norm: too many rows");
    if (vec_dim(dim) && ld_x % 8 == 0 && ld_y % 8 == 0 && aligned16(x) && aligned16(y) && aligned16(w)) {
        const int64_t pieces = dim / 8;
        const unsigned threads = unsigned(std::min<int64_t>(1024, (pieces + 31) / 32 * 32));
        launch(rms_norm_vec_kernel, unsigned(rows * groups), threads, 0, s, x, groups, dim, ld_x, w, eps,
               y, ld_y);
    } else {
        launch(rms_norm_kernel, unsigned(rows * groups), kThreads, 0, s, x, groups, dim, ld_x, w, eps, y,
               ld_y);
    }
}

void add_rms_norm(bf16 *x, const bf16 *res, int64_t rows, int64_t dim, const bf16 *w, float eps,
                  bf16 *y, cudaStream_t s) {
    if (rows == 0) return;
    if (vec_dim(dim) && aligned16(x) && aligned16(res) && aligned16(y) && aligned16(w)) {
        const unsigned threads = unsigned(std::min<int64_t>(1024, (dim / 8 + 31) / 32 * 32));
        launch(add_rms_norm_kernel, unsigned(rows), threads, 0, s, x, res, dim, w, eps, y);
    } else {  // the same roundings in two launches
        add(x, res, rows * dim, s);
        rms_norm(x, rows, 1, dim, dim, w, eps, y, dim, s);
    }
}

#ifdef DFLASH_PHASE_PROBE
// gemm_chain_bench --probe: out nullptr zeroes the table, else it is read into out. Returns the stamps per row.
int probe_table_norm(std::vector<unsigned long long> *out) { return probe_table_io(g_probe_norm, out); }
#endif

}  // namespace cuda
}  // namespace dflash
