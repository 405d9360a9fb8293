// ops.cuh: launchers of the cuda backend's kernels, one family per .cu file.
//
// Each launcher takes device pointers and a stream, validates what the kernel assumes, enqueues
// and checks the launch. Activations are bf16, accumulation fp32. Shapes are in elements.
#pragma once

#include "../backend.hpp"
#include "common.cuh"

namespace dflash {
namespace cuda {

// elementwise.cu
// dst[n] (bf16) = src[n] (f32 / f16 / bf16, device)
void convert(const void *src, dflash_dtype src_dtype, int64_t n, bf16 *dst, cudaStream_t s);
// out[n, H] = table[tokens[i], :] * scale; table: [V, H] bf16. ss_out (non-null): out's rows' sums of squares
// per 16 columns (GemmFuse::ss_out's layout, [n, ss_parts(H)]), each summed in column order.
void embed(const int32_t *tokens, int64_t n, const bf16 *table, int64_t H, float scale, bf16 *out,
           cudaStream_t s, float *ss_out = nullptr);
void add(bf16 *y, const bf16 *x, int64_t n, cudaStream_t s);                       // y += x
void swiglu(const bf16 *gate_up, int64_t rows, int64_t inter, bf16 *out, cudaStream_t s);
// In place on the row-major w[rows, cols]: w[r, c] = bf16(w[r, c] * g[c]) (Backend::fold_norm).
void fold_norm(bf16 *w, int64_t rows, int64_t cols, const bf16 *g, cudaStream_t s);
void copy_rows(const bf16 *src, int64_t ld_src, int64_t rows, int64_t width, bf16 *dst,
               int64_t ld_dst, cudaStream_t s);
// host_mapped[bytes] = src[bytes] by one block's threads: host_mapped is pinned host memory's device address
// (CudaBackend::download, unless DFLASH_MAPPED_DOWNLOAD=0). After the kernels before it.
void download_to_host(const void *src, size_t bytes, void *host_mapped, cudaStream_t s);
// k/v: [rows, ld] (first kv_width used) -> cache slot rows [slot, kv_width]
void kv_write(const bf16 *k, const bf16 *v, int64_t rows, int64_t ld, const int32_t *slots,
              int64_t kv_width, bf16 *k_cache, bf16 *v_cache, cudaStream_t s);

// norm.cu: y[r, g, :] = x[r, g, :] * rsqrt(mean(x^2) + eps) * w; w: [dim] bf16, or nullptr (ones)
void rms_norm(const bf16 *x, int64_t rows, int64_t groups, int64_t dim, int64_t ld_x,
              const bf16 *w, float eps, bf16 *y, int64_t ld_y, cudaStream_t s);

// x[rows, dim] += res (bf16-rounded), then y = rms_norm(x) * w; y may alias res
void add_rms_norm(bf16 *x, const bf16 *res, int64_t rows, int64_t dim, const bf16 *w, float eps,
                  bf16 *y, cudaStream_t s);

// rope.cu: Backend::qkv_norm_rope_write in one kernel, for an even head_dim up to 256
// (qkv_norm_rope_write_fused).
bool qkv_norm_rope_write_fused(int64_t head_dim);
void qkv_norm_rope_write(bf16 *q, int64_t ldq, bf16 *kv, int64_t ldkv, int64_t rows, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, const bf16 *q_norm, const bf16 *k_norm, float eps,
                         const int32_t *positions, const float *inv_freq, float attention_factor,
                         const int32_t *slots, bf16 *k_cache, bf16 *v_cache, cudaStream_t s);
// Backend::kv_norm_rope_write_layers in one kernel per kMaxRopeLayers layers (qkv_norm_rope_write_fused)
constexpr int kMaxRopeLayers = 16;
struct RopeLayers {
    const bf16 *k_norm[kMaxRopeLayers];  // nullptr: no norm
    bf16 *k_cache[kMaxRopeLayers], *v_cache[kMaxRopeLayers];
};
void kv_norm_rope_write_layers(bf16 *kv, int64_t ldkv, int64_t layer_ld, int layers, int64_t rows, int64_t kv_heads,
                               int64_t head_dim, const RopeLayers &per_layer, float eps, const int32_t *positions,
                               const float *inv_freq, float attention_factor, const int32_t *slots, cudaStream_t s);
// qkv_norm_rope_write's arguments for a q/k/v GEMM's epilogue (gemm's tail; DFLASH_QKV_ROPE_TAIL): the last
// column block of a unit of columns (a head, or a column block's whole heads) to store its part does the unit's
// heads' norm, rotation and cache writes, as qkv_norm_rope_write's kernel would. counters: kRopeTailCounters
// zeroed words (a unit's arrivals; its last block zeroes it again), used by one launch at a time.
constexpr int kRopeTailCounters = 1024;
struct RopeTail {
    unsigned *counters;
    const bf16 *q_norm, *k_norm;  // nullptr: no norm
    const int32_t *positions, *slots;
    const float *inv_freq;
    bf16 *k_cache, *v_cache;
    float eps, attention_factor;
    int heads, kv_heads, head_dim;
};
// The tail's work as its own kernel: qkv_norm_rope_write on y's rows (q at y, k and v after the q heads, stride ldy).
void qkv_norm_rope_write(bf16 *y, int64_t ldy, int64_t rows, const RopeTail &t, cudaStream_t s);
// per-head RMSNorm (w may be nullptr: none) then RoPE, in place, one warp per head
void head_norm_rope(bf16 *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
                    const bf16 *w, float eps, const int32_t *positions, const float *inv_freq,
                    float attention_factor, cudaStream_t s);

// rope.cu: in-place rotate-half RoPE of x[rows, heads, head_dim] (row stride ld)
void rope(bf16 *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
          const int32_t *positions, const float *inv_freq, float attention_factor, cudaStream_t s);

// gemv.cu: the small-M GEMM family. Every output element is computed in the same order
// whatever M is (batch-invariant), so a verify row equals the same row decoded alone, and the
// same whichever layout w has: row-major [N, K], or tiled (w_tiled; backend.hpp's layout).
// w must be a weight: constant while kernels run (under programmatic launch the kernel starts reading it
// before the kernels ahead of it on the stream have finished; see pdl_prologue in common.cuh).
// Uploads and device copies (not kernels) that fill it are ordered as usual.
// y[m, N] = x[m, K] . w[N, K]^T; fuse (GemmFuse: a folded norm, accumulate) only where gemm_fuse_fits.
// tail (not null): y is a fused q/k/v row (N = (heads + 2 kv_heads) * head_dim) and qkv_norm_rope_write runs on
// it after the product, in the GEMM's epilogue where the launch takes it (rope_tail_units), else as its own kernel.
void gemm(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t N, int64_t K,
          bf16 *y, int64_t ldy, cudaStream_t s, GemmFuse fuse = {}, const RopeTail *tail = nullptr);
// out[m, inter] = silu(g) * u of the GEMM with the fused [gate; up] weight w ([2 * inter, K]), in one
// kernel (each rounded to bf16 first, as gemm + swiglu round them); false (nothing launched) where
// no fused tiling fits (inter a multiple of 16 at least) or the ring-fed kernel cannot run (or, with
// fuse.norm_eps > 0, a folded norm cannot: gemm_fuse_fits, fuse.ss_in given).
bool gemm_swiglu(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t inter, int64_t K,
                 bf16 *out, int64_t ldo, cudaStream_t s, GemmFuse fuse = {});
// ss_out[m, ss_parts(N)] = the rows' sums of squares of y[m, N] (row stride ldy) per 16 columns
// (GemmFuse::ss_out where the GEMM did not fuse it).
void row_sq_parts(const bf16 *y, int64_t M, int64_t N, int64_t ldy, float *ss_out, cudaStream_t s);
// Whether the small-M kernels fold norms on this device (the ring-fed kernel runs and its folded-norm
// variants are as resident as the plain ones), and whether a call of this layout takes them.
bool fused_norm_supported();
bool gemm_fuse_fits(const bf16 *x, int64_t ldx, const bf16 *w, bool w_tiled, int64_t K);
// gemm_wide.cu: the wide GEMM, for GemmRows::Wide calls (prefill chunks): 64 x 128 tiles of mma
// fed through shared memory, its sums ordered unlike the small-M family's (so never for rows that
// must agree with narrower calls). gemm_wide_fits: whether it takes the call (at least
// kWideMinRows rows, where it beats the small-M kernels; x 16-byte vectorizable, K % 8 == 0;
// row-major w 16-byte aligned). Then the same contracts as gemm and gemm_swiglu (any inter).
constexpr int64_t kWideMinRows = 48;
bool gemm_wide_fits(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t K);
void gemm_wide(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t N, int64_t K, bf16 *y,
               int64_t ldy, cudaStream_t s);
void gemm_wide_swiglu(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t inter,
                      int64_t K, bf16 *out, int64_t ldo, cudaStream_t s);
// logits[m, V] fp32 = softcap(x . lm_head^T * multiplier)
void logits(const bf16 *x, int64_t M, const bf16 *w, bool w_tiled, int64_t V, int64_t K,
            float multiplier, float softcap, float *out, cudaStream_t s);
// tokens[m] = argmax of the same logits (lowest index on ties); partial: scratch of
// logits_argmax_scratch_bytes(M, V) bytes.
size_t logits_argmax_scratch_bytes(int64_t M, int64_t V);
void logits_argmax(const bf16 *x, int64_t M, const bf16 *w, bool w_tiled, int64_t V, int64_t K,
                   float multiplier, float softcap, void *partial, int32_t *tokens,
                   cudaStream_t s);
// Whether this device runs the tiled kernels (the ring-fed GEMM fits and is enabled); dst =
// row-major src[N, K] in the tiled layout (tiled_elements(N, K) elements, zero padded).
bool tiled_gemm_supported();
void tile_weight(const bf16 *src, int64_t N, int64_t K, bf16 *dst, cudaStream_t s);

// attention.cu: split-KV paged attention; scratch of attention_scratch_bytes(...) bytes.
size_t attention_scratch_bytes(int64_t nq, int64_t n_heads, int64_t head_dim, int64_t n_kv_heads,
                               const PagedKeys &keys);
void attention(const bf16 *q, int64_t ldq, int64_t nq, const int32_t *q_positions, int64_t n_heads,
               int64_t n_kv_heads, int64_t head_dim, float scale, AttentionMask mask,
               const PagedKeys &keys, void *scratch, bf16 *out, cudaStream_t s);

// sampling.cu
void sampling_probs(float *rows, int64_t m, int64_t vocab, float temperature, float top_p,
                    int32_t top_k, cudaStream_t s);
void sample_rows(const float *probs, int64_t m, int64_t vocab, RngKey key, uint32_t first_row,
                 uint32_t purpose, int32_t *out, cudaStream_t s);
void greedy_accept(const int32_t *tokens, const int32_t *posterior, int64_t n, int32_t *out,
                   cudaStream_t s);
void rejection_accept(const float *p, const int32_t *tokens, const float *q, int64_t n,
                      int64_t vocab, RngKey key, int32_t *out, cudaStream_t s);

}  // namespace cuda
}  // namespace dflash
