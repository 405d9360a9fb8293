// backend.hpp: the op interface every backend implements, and nothing more.
//
// Engine logic (configs, validation, paged-block bookkeeping, sequence state, the propose
// pipeline) lives above this interface and is written once. A backend owns a memory space and a
// stream and implements the ops over "device" pointers of that space (plain host memory for the
// host backend). Activations are in the backend's activation dtype (F32 on host, BF16 on cuda);
// weights keep the dtype they arrived in. Ops enqueue on the backend's stream in call order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common.hpp"
#include "philox.hpp"

namespace dflash {

// The tiled GEMM weight layout a backend may ask for (Backend::tiles_gemm_weights): tiles of
// kTileRows rows x kTileCols columns, each tile's rows contiguous (row-major inside the tile), the
// tiles of one row band in column order, then the next band: element (r, c) of a [rows, cols]
// matrix sits at ((r / 16) * ceil(cols / 64) + c / 64) * 1024 + (r % 16) * 64 + c % 64, and the
// tiles are zero past rows and cols. A GEMM kernel then streams each warp's whole share of the
// weight as one contiguous run instead of 128-byte pieces of many rows.
constexpr int64_t kTileRows = 16, kTileCols = 64;
inline int64_t tiled_elements(int64_t rows, int64_t cols) {
    return (rows + kTileRows - 1) / kTileRows * ((cols + kTileCols - 1) / kTileCols) * kTileRows * kTileCols;
}
// Where element (r, c) of a tiled matrix with `cols` columns sits.
inline int64_t tiled_index(int64_t cols, int64_t r, int64_t c) {
    const int64_t chunks = (cols + kTileCols - 1) / kTileCols;
    return ((r / kTileRows) * chunks + c / kTileCols) * (kTileRows * kTileCols) + (r % kTileRows) * kTileCols +
           c % kTileCols;
}

// A weight matrix [rows, cols] in backend memory: row-major, or tiled as above.
struct WeightView {
    const void *data = nullptr;
    dflash_dtype dtype = DFLASH_DTYPE_F32;
    int64_t rows = 0;
    int64_t cols = 0;
    bool tiled = false;  // the tiled GEMM layout above, else row-major

    // Rows [first, first + count) of this matrix (tiled: first a multiple of kTileRows).
    WeightView slice_rows(int64_t first, int64_t count) const {
        WeightView v = *this;
        if (tiled) {
            if (first % kTileRows != 0)
                fail(DFLASH_STATUS_INTERNAL, "a tiled weight is sliced at row ", first,
                     ", not a multiple of ", kTileRows);
            v.data = static_cast<const char *>(data) +
                     tiled_elements(first, cols) * int64_t(dtype_size(dtype));
        } else {
            v.data = static_cast<const char *>(data) + first * cols * int64_t(dtype_size(dtype));
        }
        v.rows = count;
        return v;
    }
};

// Which keys a query may see. Positions are the stamped absolute positions.
struct AttentionMask {
    bool causal = false;    // key position <= query position
    int32_t window = 0;     // > 0: |query - key| < window (one-sided when causal)
};

// A paged K/V cache of one layer, plus the keys of one sequence to attend over.
// Logical key r lives at physical slot block_table[(r % ring_slots) / block] * block
// + (r % ring_slots) % block, with its position at slot_positions[r % ring_slots].
struct PagedKeys {
    const void *k_cache = nullptr;          // [num_blocks, block_size, n_kv_heads, head_dim] act
    const void *v_cache = nullptr;          // same layout
    const int32_t *block_table = nullptr;   // [ring_slots / block_size] device
    const int32_t *slot_positions = nullptr;// [ring_slots] device
    int32_t block_size = DFLASH_KV_BLOCK_SIZE;
    int32_t ring_slots = 0;
    int64_t first_key = 0;                  // logical index of the first visible key
    int64_t num_keys = 0;
    // Non-null: the key count lives here ([1] int32 device) and the kernels read it there, so a
    // graph replays at any length; num_keys is then the host's copy (checks). Nothing the cuda
    // backend launches depends on the count then (its splits depend on the ring's capacity).
    const int32_t *num_keys_device = nullptr;
    // Calls of up to this many query rows lay their key splits out alike (rows that must agree bit
    // for bit: verify blocks and decode steps; the model's widest block): the cuda backend sizes its
    // splits for this many rows, not for the call's; wider calls (prefill chunks) and 0 use their own.
    int64_t uniform_rows = 0;
    // >= 0: all but the last fresh_keys keys (their K/V, block-table entries and slot positions, and the
    // key count) were written before the call's chain of kernels began (a copy from the host ended it),
    // so the cuda backend may read them before its wait for the kernels before it (the target's
    // steps: fresh_keys = the step's rows). -1: nothing is known; every read waits. Non-null
    // fresh_keys_device: the count lives there ([1] int32 device, written as the key count is: graphs), and
    // fresh_keys >= 0 only says that it does.
    int64_t fresh_keys = -1;
    const int32_t *fresh_keys_device = nullptr;
};

// What a GEMM's rows must agree with (DESIGN §5). Uniform: each row gets the same bits as the same
// row in a call of any other row count (verify blocks, decode steps, the drafter's blocks and
// context rows), which is what keeps speculative output equal to autoregressive output. Wide: rows
// no narrower call must reproduce (the target's prefill chunks), so a backend may take a
// throughput kernel whose sums run in another order.
enum class GemmRows { Uniform, Wide };

// What a GEMM does around its product, where the model folds RMSNorms into GEMMs
// (Backend::folds_norms). norm_eps > 0: each x row is RMS-normed on the way in, its norm's weight
// already folded into w's columns (Backend::fold_norm), so y = (x . w^T) * rsqrt(mean(x^2) + eps).
// accumulate: y += the product (the product rounded to the activation dtype first, then the sum, as
// a gemm then add rounds them): the residual add that ends an attention or MLP block.
//
// Row statistics between the two: ss_out (non-null): the backend writes the rows' sums of squares of
// the stored y there, in parts of 16 columns ([m, ss_parts(N)] floats, row stride ss_parts(N));
// ss_in (with norm_eps; may be nullptr): those parts of x's rows, written by the GEMM that last stored
// x with ss_out, which a backend may use instead of summing x itself (the cuda kernels do).
struct GemmFuse {
    float norm_eps = 0.f;
    bool accumulate = false;
    const float *ss_in = nullptr;
    float *ss_out = nullptr;
    bool any() const { return norm_eps > 0.f || accumulate; }
};
DFLASH_HOST_DEVICE inline int64_t ss_parts(int64_t width) { return (width + 15) / 16; }  // GemmFuse's parts per row
// GemmFuse::ss_out from host rows: out[i, p] = the sum of y[i, 16p .. 16p + 15]^2 (row stride ldy), in column order.
inline void sum_square_parts(const float *y, int64_t m, int64_t n, int64_t ldy, float *out) {
    for (int64_t i = 0; i < m; ++i)
        for (int64_t p = 0; p < ss_parts(n); ++p) {
            float sq = 0.f;
            for (int64_t c = p * 16; c < n && c < p * 16 + 16; ++c) sq += y[i * ldy + c] * y[i * ldy + c];
            out[i * ss_parts(n) + p] = sq;
        }
}

// A captured sequence of ops (a CUDA graph), replayed with the pointers and host-side values it
// was captured with: whatever changes between replays must live in device memory.
class Graph {
public:
    virtual ~Graph() = default;
};

class Backend {
public:
    virtual ~Backend() = default;

    virtual dflash_backend kind() const = 0;
    virtual dflash_dtype act_dtype() const = 0;
    // nullptr when every op below is implemented, else a description of what is missing.
    virtual const char *missing_ops() const { return nullptr; }
    // The dtype a weight given in `given` is stored in (the host keeps it; cuda stores bf16, the
    // one dtype its weight-streaming kernels read).
    virtual dflash_dtype weight_dtype(dflash_dtype given) const { return given; }
    // Whether GEMM weights (every matrix gemm / logits / logits_argmax read) are to be stored in the
    // tiled layout; tile_gemm_weight writes row-major `src` tiled into dst (tiled_elements(src.rows,
    // src.cols) elements of src.dtype). The host keeps row-major weights.
    virtual bool tiles_gemm_weights() const { return false; }
    virtual void tile_gemm_weight(const WeightView &src, void *dst) {
        (void)src, (void)dst;
        fail(DFLASH_STATUS_NOT_SUPPORTED, "this backend keeps GEMM weights row-major");
    }

    // --- memory: alloc throws Error(OUT_OF_MEMORY); release accepts nullptr ---
    virtual void *alloc(size_t bytes) = 0;
    virtual void release(void *ptr) noexcept = 0;
    virtual void upload(void *dst, const void *host_src, size_t bytes) = 0;
    virtual void download(void *host_dst, const void *src, size_t bytes) = 0;  // waits
    virtual void copy(void *dst, const void *src, size_t bytes) = 0;
    virtual void synchronize() = 0;

    // --- graphs (DESIGN §5): record the ops enqueued between begin_capture and end_capture ---
    virtual bool graphs_enabled() const { return false; }
    virtual void begin_capture() { fail(DFLASH_STATUS_NOT_SUPPORTED, "this backend has no graphs"); }
    // The recorded ops, instantiated; nullptr when the capture failed (the stream is usable again,
    // nothing ran: the caller runs the ops eagerly). Always ends the capture.
    virtual std::unique_ptr<Graph> end_capture() { return nullptr; }
    virtual void replay(const Graph &) { fail(DFLASH_STATUS_NOT_SUPPORTED, "this backend has no graphs"); }
    // Changes whenever op scratch is reallocated: graphs captured before another value are stale.
    virtual uint64_t scratch_epoch() const { return 0; }

    // --- ops ---
    // dst[n, width] (act) = src[n, width] (src_dtype; host memory if !src_on_device).
    virtual void convert_rows(const void *src, dflash_dtype src_dtype, bool src_on_device,
                              int64_t n, int64_t width, void *dst) = 0;
    // out[n, H] = table[tokens[i]] * scale.  tokens: [n] int32 device. ss_out (non-null): the rows' sums of
    // squares of the stored out, as GemmFuse::ss_out ([n, ss_parts(H)]), for a first GEMM that norms out itself.
    virtual void embed(const int32_t *tokens, int64_t n, WeightView table, float scale,
                       void *out, float *ss_out = nullptr) = 0;
    // y[r, g, :] = x[r, g, :] / rms(x[r, g, :]) * w, for `groups` vectors of `dim` per row;
    // rows are ld_x / ld_y elements apart. y may alias x.
    virtual void rms_norm(const void *x, int64_t rows, int64_t groups, int64_t dim, int64_t ld_x,
                          WeightView w, float eps, void *y, int64_t ld_y) = 0;
    // y[m, w.rows] = x[m, w.cols] @ w^T.  Row strides ldx, ldy (elements). rows: see GemmRows;
    // fuse: see GemmFuse (accumulate needs ldy == w.rows).
    virtual void gemm(const void *x, int64_t m, int64_t ldx, WeightView w, void *y, int64_t ldy,
                      GemmRows rows = GemmRows::Uniform, GemmFuse fuse = {}) = 0;
    // Whether the model is to fold each RMSNorm that feeds a GEMM into that GEMM (GemmFuse): the
    // norm's weight into the GEMM weight's columns at finalize (fold_norm), the norm's statistics into
    // the GEMM's pass over x, and the residual add after a GEMM into its store. The cuda backend folds
    // unless DFLASH_FUSED_NORM=0 (measured: cuda_backend.cu), the host backend where DFLASH_HOST_FOLD=1,
    // so the CPU tests cover the models' side of it.
    virtual bool folds_norms() const { return false; }
    // Where the model folds norms: whether the norming op `op` takes its rows' sums of squares from the
    // producer (GemmFuse::ss_in; the producer then writes them, ss_out), or norms x itself (a norm kernel before
    // a plain GEMM on the cuda backend). Never depends on the row count (rows agree at any M).
    enum class NormOp { Gemm, SwiGLU };  // the q/k/v projections; gate/up
    virtual bool reads_norm_stats(NormOp op) const { return (void)op, folds_norms(); }
    // In place on the row-major matrix w: w[r, c] *= g[c] (rounded to w's dtype).
    virtual void fold_norm(WeightView w, WeightView g) {
        (void)w, (void)g;
        fail(DFLASH_STATUS_NOT_SUPPORTED, "this backend does not fold norms into GEMM weights");
    }
    // In-place rotate-half RoPE of x[rows, heads, head_dim] (row stride ld) at positions[rows]
    // (device); cos/sin = cos/sin(pos * inv_freq[head_dim/2]) * attention_factor.
    virtual void rope(void *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
                      const int32_t *positions, const float *inv_freq,
                      float attention_factor) = 0;
    // Writes k/v rows [rows, n_kv_heads*head_dim] (row strides ld) into the cache slots
    // slots[rows] (device; physical slot = block * block_size + offset); a row whose slot is negative is not
    // written (a graphed propose's projection pads its rows to a fixed count with them).
    virtual void kv_write(const void *k, const void *v, int64_t rows, int64_t ld,
                          const int32_t *slots, int64_t kv_width, void *k_cache,
                          void *v_cache) = 0;
    // out[nq, n_heads*head_dim] = softmax(q k^T * scale + mask) v over the paged keys;
    // q: nq rows of n_heads*head_dim at row stride ldq (>= n_heads*head_dim, even: a fused
    // q/k/v row), query positions q_positions[nq] (device).
    virtual void attention(const void *q, int64_t ldq, int64_t nq, const int32_t *q_positions,
                           int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                           AttentionMask mask, const PagedKeys &keys, void *out) = 0;
    virtual void add(void *y, const void *x, int64_t n) = 0;  // y += x

    // --- fused ops: the defaults compose the ops above; a backend may do them in one pass, with
    // the same roundings (the sum is rounded to the activation dtype before it is normed, the
    // normed head before it is rotated) ---
    // x[rows, dim] += res (rounded), then y = rms_norm(x) * w. y may alias res (not x).
    virtual void add_rms_norm(void *x, const void *res, int64_t rows, int64_t dim, WeightView w,
                              float eps, void *y) {
        add(x, res, rows * dim);
        rms_norm(x, rows, 1, dim, dim, w, eps, y, dim);
    }
    // In place on x[rows, heads, head_dim] (row stride ld): per-head RMSNorm with w (skipped when
    // w is nullptr), then RoPE as rope().
    virtual void head_norm_rope(void *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
                                const WeightView *w, float eps, const int32_t *positions,
                                const float *inv_freq, float attention_factor) {
        if (w) rms_norm(x, rows, heads, head_dim, ld, *w, eps, x, ld);
        rope(x, rows, heads, head_dim, ld, positions, inv_freq, attention_factor);
    }
    // The attention inputs of `rows` tokens: q[rows] (row stride ldq) of heads x head_dim and
    // kv[rows] (row stride ldkv) of [k | v], kv_heads x head_dim each. head_norm_rope on the q
    // heads (q_norm) and the k heads (k_norm), then kv_write of k and v to slots[rows]. heads may
    // be 0 (q unused: the drafter's context rows). One pass where the backend fuses it, with the
    // same roundings. The target passes one fused q/k/v row (kv = q + heads * head_dim).
    // head_norm_rope and this: positions, slots, inv_freq and the norms must not come from a kernel of the
    // same chain (the step's upload writes them), since the cuda kernels read them before their wait.
    virtual void qkv_norm_rope_write(void *q, int64_t ldq, void *kv, int64_t ldkv, int64_t rows, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, const WeightView *q_norm,
                                     const WeightView *k_norm, float eps, const int32_t *positions,
                                     const float *inv_freq, float attention_factor,
                                     const int32_t *slots, void *k_cache, void *v_cache) {
        const int64_t kv_width = kv_heads * head_dim;
        void *v = static_cast<char *>(kv) + size_t(kv_width) * dtype_size(act_dtype());
        if (heads > 0)
            head_norm_rope(q, rows, heads, head_dim, ldq, q_norm, eps, positions, inv_freq, attention_factor);
        head_norm_rope(kv, rows, kv_heads, head_dim, ldkv, k_norm, eps, positions, inv_freq, attention_factor);
        kv_write(kv, v, rows, ldkv, slots, kv_width, k_cache, v_cache);
    }
    // Where a q/k/v GEMM's rows go through qkv_norm_rope_write (RopeArgs::q / kv their q and k|v heads).
    struct RopeArgs {
        void *q;
        int64_t ldq;
        void *kv;  // k heads, then v heads
        int64_t ldkv;
        const WeightView *q_norm, *k_norm;
        float eps;
        const int32_t *positions;  // the rows' (queries' and keys')
        const float *inv_freq;
        float attention_factor;
        const int32_t *slots;
    };
    // gemm(x, m, ldx, w) into the fused q/k/v rows r.q (row stride r.ldq, w.rows = (heads + 2 kv_heads) *
    // head_dim: q heads, then k heads, then v heads; r.kv = r.q + heads * head_dim, r.ldkv = r.ldq), then
    // qkv_norm_rope_write on them into k_cache / v_cache. The default composes the two; a backend may do the
    // second in the GEMM's epilogue (the same values in q, the heads and the caches).
    virtual void gemm_qkv_rope(const void *x, int64_t m, int64_t ldx, WeightView w, GemmRows rows, GemmFuse fuse,
                               const RopeArgs &r, int64_t heads, int64_t kv_heads, int64_t head_dim, void *k_cache,
                               void *v_cache) {
        gemm(x, m, ldx, w, r.q, r.ldq, rows, fuse);
        qkv_norm_rope_write(r.q, r.ldq, r.kv, r.ldkv, m, heads, kv_heads, head_dim, r.q_norm, r.k_norm, r.eps,
                            r.positions, r.inv_freq, r.attention_factor, r.slots, k_cache, v_cache);
    }
    // qkv_norm_rope_write's kv part (heads = 0) for `layers` layers of the same rows at once: layer l's
    // [k | v] start at column l * layer_ld of kv (the drafter's context K/V, every layer in one GEMM row), its
    // k norm is k_norms[l] (or none: k_norms null), its caches k_caches[l] / v_caches[l]. The same values as
    // one qkv_norm_rope_write per layer (the default), in one launch where the backend fuses it.
    virtual void kv_norm_rope_write_layers(void *kv, int64_t ldkv, int64_t layer_ld, int64_t layers, int64_t rows,
                                           int64_t kv_heads, int64_t head_dim, const WeightView *const *k_norms,
                                           float eps, const int32_t *positions, const float *inv_freq,
                                           float attention_factor, const int32_t *slots, void *const *k_caches,
                                           void *const *v_caches) {
        for (int64_t l = 0; l < layers; ++l)
            qkv_norm_rope_write(nullptr, 0, static_cast<char *>(kv) + size_t(l * layer_ld) * dtype_size(act_dtype()),
                                ldkv, rows, 0, kv_heads, head_dim, nullptr, k_norms ? k_norms[l] : nullptr, eps,
                                positions, inv_freq, attention_factor, slots, k_caches[l], v_caches[l]);
    }
    // out[rows, inter] = silu(gu[:, :inter]) * gu[:, inter:]; gu: [rows, 2*inter]
    virtual void swiglu(const void *gate_up, int64_t rows, int64_t inter, void *out) = 0;
    // out[m, inter] = swiglu(x . gate_up^T) with the fused [gate; up] weight ([2 * inter, k]):
    // gemm into gate_up_scratch ([m, 2 * inter]), then swiglu; a backend may fuse the two (same
    // roundings), and then leaves the scratch unused.
    // fuse.norm_eps as gemm's (accumulate is not taken).
    virtual void gemm_swiglu(const void *x, int64_t m, int64_t ldx, WeightView gate_up, int64_t inter,
                             void *gate_up_scratch, void *out, GemmRows rows = GemmRows::Uniform,
                             GemmFuse fuse = {}) {
        if (fuse.accumulate) fail(DFLASH_STATUS_INTERNAL, "gemm_swiglu does not accumulate");
        gemm(x, m, ldx, gate_up, gate_up_scratch, 2 * inter, rows, fuse);
        swiglu(gate_up_scratch, m, inter, out);
    }
    // tokens[m] = argmax_v softcap(h[m] . lm_head[v] * multiplier); full logits never stored.
    virtual void logits_argmax(const void *h, int64_t m, WeightView lm_head, float multiplier,
                               float softcap, int32_t *tokens) = 0;
    // dst[r, :width] = src[r, :width] (act), row strides ld_src / ld_dst elements.
    virtual void copy_rows(const void *src, int64_t ld_src, int64_t rows, int64_t width, void *dst,
                           int64_t ld_dst) = 0;

    // --- sampling (all buffers in backend memory) ---
    // out[m, V] fp32 = softcap(h[m] . lm_head * multiplier): the full logits, for sampling only.
    virtual void logits(const void *h, int64_t m, WeightView lm_head, float multiplier,
                        float softcap, float *out) = 0;
    // In place, rows of logits -> sampling probabilities exactly as dflash.model._sampling_probs:
    // scores = logits / T; keep the top_k (0 = all); softmax; keep the smallest prefix (by
    // descending probability) whose mass before each kept token is < top_p; renormalise.
    virtual void sampling_probs(float *rows, int64_t m, int64_t vocab, float temperature,
                                float top_p, int32_t top_k) = 0;
    // out[i] = inverse-CDF draw from probs row i with rng_uniform(key, first_row + i, purpose).
    virtual void sample_rows(const float *probs, int64_t m, int64_t vocab, RngKey key,
                             uint32_t first_row, uint32_t purpose, int32_t *out) = 0;
    // Greedy verification of tokens[n] = [anchor, drafts...] against posterior[n] (the target's
    // argmax of each row): out[0] = accepted (longest prefix with tokens[j] == posterior[j-1]),
    // out[1] = posterior[accepted].
    virtual void greedy_accept(const int32_t *tokens, const int32_t *posterior, int64_t n,
                               int32_t *out) = 0;
    // Leviathan rejection sampling: p[n, V] target probs, tokens[n] = [anchor, drafts...],
    // q[n-1, V] the proposal rows (nullptr: one-hot on the drafts). out[0] = accepted,
    // out[1] = the next token (from p[n-1], or from max(p - q, 0) at the first rejection).
    virtual void rejection_accept(const float *p, const int32_t *tokens, const float *q,
                                  int64_t n, int64_t vocab, RngKey key, int32_t *out) = 0;
};

std::shared_ptr<Backend> make_host_backend();
// Throws Error(NOT_SUPPORTED) in a host-only build, NO_DEVICE without a device.
// graphs: whether ops may be captured and replayed as CUDA graphs (off: always eager).
std::shared_ptr<Backend> make_cuda_backend(int device, uint64_t stream, bool graphs);
int cuda_device_count();  // throws like make_cuda_backend
bool cuda_compiled();
const char *cuda_arch_list();

// RAII owner of one backend allocation.
class DeviceBuffer {
public:
    DeviceBuffer() = default;
    DeviceBuffer(Backend *backend, size_t bytes)
        : backend_(backend), ptr_(bytes ? backend->alloc(bytes) : nullptr), bytes_(bytes) {}
    DeviceBuffer(const DeviceBuffer &) = delete;
    DeviceBuffer &operator=(const DeviceBuffer &) = delete;
    DeviceBuffer(DeviceBuffer &&o) noexcept { *this = std::move(o); }
    DeviceBuffer &operator=(DeviceBuffer &&o) noexcept {
        if (this != &o) {
            reset();
            backend_ = o.backend_;
            ptr_ = o.ptr_;
            bytes_ = o.bytes_;
            o.ptr_ = nullptr;
            o.bytes_ = 0;
        }
        return *this;
    }
    ~DeviceBuffer() { reset(); }

    void reset() {
        if (ptr_) backend_->release(ptr_);
        ptr_ = nullptr;
        bytes_ = 0;
    }
    void *get() const { return ptr_; }
    template <typename T>
    T *as() const { return static_cast<T *>(ptr_); }
    size_t bytes() const { return bytes_; }

private:
    Backend *backend_ = nullptr;
    void *ptr_ = nullptr;
    size_t bytes_ = 0;
};

}  // namespace dflash
