// elementwise.cu: dtype conversion, embedding gather, residual add, SwiGLU, row copies and the
// paged KV write. All memory-bound and tiny next to the GEMMs; written for clarity, one thread
// per element (grid-stride), fp32 math, one bf16 rounding per output.
#include "ops.cuh"

namespace dflash {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void convert_kernel(const T *src, int64_t n, bf16 *dst) {
    pdl_prologue();
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x)
        dst[i] = to_bf16(to_float(src[i]));
}

// A small result to mapped pinned host memory (download_to_host): 4-byte words where both ends allow, else bytes.
// Waits for the kernels before it; lets nothing launch early (the host waits for it next).
__global__ void to_host_kernel(const unsigned char *src, size_t bytes, unsigned char *host) {
    pdl_wait();
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(host) | bytes) & 3) == 0) {
        const uint32_t *s = reinterpret_cast<const uint32_t *>(src);
        uint32_t *h = reinterpret_cast<uint32_t *>(host);
        for (size_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) h[i] = s[i];
    } else {
        for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) host[i] = src[i];
    }
}

// tokens: [n]; table: [V, H]; out: [n, H]
__global__ void embed_kernel(const int32_t *tokens, int64_t n, const bf16 *table, int64_t H,
                             float scale, bf16 *out) {
    pdl_prologue();
    const int64_t row = blockIdx.y;
    const bf16 *src = table + int64_t(tokens[row]) * H;
    for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < H;
         c += int64_t(gridDim.x) * blockDim.x)
        out[row * H + c] = to_bf16(to_float(src[c]) * scale);
}

// embed_kernel with the stored rows' sums of squares (GemmFuse::ss_out's parts, as row_sq_parts sums them): one
// thread per (row, 16 columns), which it stores, then sums their stored values' squares in column order.
__global__ void embed_sq_kernel(const int32_t *tokens, int64_t n, const bf16 *table, int64_t H, float scale,
                                bf16 *out, float *ss_out) {
    pdl_prologue();
    const int64_t parts = ss_parts(H);
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n * parts;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t row = i / parts, c0 = i % parts * 16;
        const bf16 *src = table + int64_t(tokens[row]) * H;
        float sq = 0.f;
        for (int64_t c = c0; c < H && c < c0 + 16; ++c) {
            const bf16 v = to_bf16(to_float(src[c]) * scale);
            out[row * H + c] = v;
            sq += to_float(v) * to_float(v);
        }
        ss_out[i] = sq;
    }
}

__global__ void add_kernel(bf16 *y, const bf16 *x, int64_t n) {
    pdl_prologue();
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x)
        y[i] = to_bf16(to_float(y[i]) + to_float(x[i]));
}

// gate_up: [rows, 2*inter] (gate | up); out: [rows, inter]
__global__ void swiglu_kernel(const bf16 *gate_up, int64_t rows, int64_t inter, bf16 *out) {
    pdl_prologue();
    const int64_t n = rows * inter;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t r = i / inter, c = i % inter;
        const float g = to_float(gate_up[r * 2 * inter + c]);
        const float u = to_float(gate_up[r * 2 * inter + inter + c]);
        out[i] = to_bf16(swiglu_value(g, u));
    }
}

// w: [rows, cols] row-major, in place: w[r, c] = bf16(w[r, c] * g[c])
__global__ void fold_norm_kernel(bf16 *w, int64_t n, int64_t cols, const bf16 *g) {
    pdl_prologue();
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x)
        w[i] = to_bf16(to_float(w[i]) * to_float(g[i % cols]));
}

// src: [rows, ld_src]; dst: [rows, ld_dst]; copies the first `width` of each row
__global__ void copy_rows_kernel(const bf16 *src, int64_t ld_src, int64_t rows, int64_t width,
                                 bf16 *dst, int64_t ld_dst) {
    pdl_prologue();
    const int64_t n = rows * width;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t r = i / width, c = i % width;
        dst[r * ld_dst + c] = src[r * ld_src + c];
    }
}

// k, v: [rows, ld]; caches: [slots, kv_width]
__global__ void kv_write_kernel(const bf16 *k, const bf16 *v, int64_t rows, int64_t ld,
                                const int32_t *slots, int64_t kv_width, bf16 *k_cache,
                                bf16 *v_cache) {
    pdl_prologue();
    const int64_t n = rows * kv_width;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t r = i / kv_width, c = i % kv_width;
        const int64_t slot = slots[r];
        if (slot < 0) continue;  // a padding row: not written
        k_cache[slot * kv_width + c] = k[r * ld + c];
        v_cache[slot * kv_width + c] = v[r * ld + c];
    }
}

unsigned blocks_for(int64_t n) {
    return unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

}  // namespace

void convert(const void *src, dflash_dtype src_dtype, int64_t n, bf16 *dst, cudaStream_t s) {
    if (n == 0) return;
    switch (src_dtype) {
        case DFLASH_DTYPE_F32:
            launch(convert_kernel<float>, blocks_for(n), kThreads, 0, s, static_cast<const float *>(src), n,
                   dst);
            break;
        case DFLASH_DTYPE_F16:
            launch(convert_kernel<__half>, blocks_for(n), kThreads, 0, s, static_cast<const __half *>(src), n,
                   dst);
            break;
        case DFLASH_DTYPE_BF16:
            launch(convert_kernel<bf16>, blocks_for(n), kThreads, 0, s, static_cast<const bf16 *>(src), n,
                   dst);
            break;
    }
}

void embed(const int32_t *tokens, int64_t n, const bf16 *table, int64_t H, float scale, bf16 *out,
           cudaStream_t s, float *ss_out) {
    if (n == 0) return;
    if (ss_out) {
        const int64_t parts = n * ss_parts(H);
        launch(embed_sq_kernel, unsigned(std::min<int64_t>((parts + kThreads - 1) / kThreads, 4096)), kThreads, 0, s,
               tokens, n, table, H, scale, out, ss_out);
        return;
    }
    const dim3 grid(unsigned(std::min<int64_t>((H + kThreads - 1) / kThreads, 64)), unsigned(n));
    launch(embed_kernel, grid, kThreads, 0, s, tokens, n, table, H, scale, out);
}

void add(bf16 *y, const bf16 *x, int64_t n, cudaStream_t s) {
    if (n == 0) return;
    launch(add_kernel, blocks_for(n), kThreads, 0, s, y, x, n);
}

void swiglu(const bf16 *gate_up, int64_t rows, int64_t inter, bf16 *out, cudaStream_t s) {
    if (rows * inter == 0) return;
    launch(swiglu_kernel, blocks_for(rows * inter), kThreads, 0, s, gate_up, rows, inter, out);
}

void fold_norm(bf16 *w, int64_t rows, int64_t cols, const bf16 *g, cudaStream_t s) {
    if (rows * cols == 0) return;
    launch(fold_norm_kernel, blocks_for(rows * cols), kThreads, 0, s, w, rows * cols, cols, g);
}

void copy_rows(const bf16 *src, int64_t ld_src, int64_t rows, int64_t width, bf16 *dst,
               int64_t ld_dst, cudaStream_t s) {
    if (rows * width == 0) return;
    launch(copy_rows_kernel, blocks_for(rows * width), kThreads, 0, s, src, ld_src, rows, width, dst,
           ld_dst);
}

void download_to_host(const void *src, size_t bytes, void *host_mapped, cudaStream_t s) {
    if (!bytes) return;
    launch(to_host_kernel, 1, kThreads, 0, s, static_cast<const unsigned char *>(src), bytes,
           static_cast<unsigned char *>(host_mapped));
}

void kv_write(const bf16 *k, const bf16 *v, int64_t rows, int64_t ld, const int32_t *slots,
              int64_t kv_width, bf16 *k_cache, bf16 *v_cache, cudaStream_t s) {
    if (rows * kv_width == 0) return;
    launch(kv_write_kernel, blocks_for(rows * kv_width), kThreads, 0, s, k, v, rows, ld, slots,
           kv_width, k_cache, v_cache);
}

}  // namespace cuda
}  // namespace dflash
