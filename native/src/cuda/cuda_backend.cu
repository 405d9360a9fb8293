// cuda_backend.cu: the cuda backend: device, stream, memory, and the op entry points.
//
// Each op validates what its kernel assumes and calls the launcher of its family (ops.cuh:
// elementwise.cu, norm.cu, rope.cu, gemv.cu, attention.cu, sampling.cu). Activations are bf16,
// weights are stored bf16 (weight_dtype), accumulation is fp32. Scratch the kernels need
// (argmax partials, attention split partials) grows on first use and is then reused, so steady
// state allocates nothing. Copies back to the host go through one pinned buffer and an event:
// the host waits for its own copy, never for the whole device; small uploads go through another (upload()).
#include <cstdlib>
#include <cstdio>
#include <vector>

#include "../backend.hpp"
#include "ops.cuh"
#include "step_timing.cuh"

namespace dflash {
namespace {

const bf16 *as_bf16(const void *p) { return static_cast<const bf16 *>(p); }
bf16 *as_bf16(void *p) { return static_cast<bf16 *>(p); }

// Only the GEMM family reads tiled weights (backend.hpp); every other op needs row-major.
const bf16 *weight_data(const WeightView &w, const char *op, bool tiled_ok = false) {
    if (w.dtype != DFLASH_DTYPE_BF16)
        fail(DFLASH_STATUS_INTERNAL, "cuda ", op, ": weights must be BF16 (got ", dtype_name(w.dtype), ")");
    if (w.tiled && !tiled_ok) fail(DFLASH_STATUS_INTERNAL, "cuda ", op, ": got a tiled (GEMM-layout) weight");
    return as_bf16(w.data);
}

class CudaGraph final : public Graph {
public:
    explicit CudaGraph(cudaGraphExec_t exec) : exec(exec) {}
    ~CudaGraph() override { cudaGraphExecDestroy(exec); }
    cudaGraphExec_t exec;
};

class CudaBackend final : public Backend {
public:
    CudaBackend(int device, uint64_t stream, bool graphs) : device_(device), graphs_(graphs) {
        DFLASH_CUDA_CHECK(cudaSetDevice(device));
        if (stream) {
            stream_ = reinterpret_cast<cudaStream_t>(stream);
        } else {
            DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
            owns_stream_ = true;
        }
        cudaError_t err = cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming);
        if (err == cudaSuccess) err = cudaMallocHost(&pinned_, kPinnedBytes);
        if (err == cudaSuccess) err = cudaMallocHost(&staging_, kStagingBytes);
        // A small download's bytes go to pinned_ by a one-block kernel through its device address (pinned memory
        // is mapped under unified addressing), not by a device-to-host copy: a kernel right after the step's
        // kernels instead of a copy-engine operation. Session 49 on an H100: a propose's result copied 3.8 us after
        // its graph (p90 3.9) instead of 8.0 (p90 10.7); the steps 0.1-1.4% faster (docs/speed-log.md).
        // DFLASH_MAPPED_DOWNLOAD=0 takes the copy; so does a device that gives pinned_ no device address.
        static const bool mapped_download = env_switch_on("DFLASH_MAPPED_DOWNLOAD");
        if (err == cudaSuccess && mapped_download &&
            cudaHostGetDevicePointer(&pinned_device_, pinned_, 0) != cudaSuccess) {
            (void)cudaGetLastError();
            pinned_device_ = nullptr;
        }
        // The q/k/v GEMMs' rope tail (gemm_qkv_rope): its units' counters, zero between launches.
        const bool rope_tail = env_opt_in("DFLASH_QKV_ROPE_TAIL");  // per backend: test_ops makes one of each
        if (err == cudaSuccess && rope_tail) {
            err = cudaMalloc(&rope_counters_, cuda::kRopeTailCounters * sizeof(unsigned));
            if (err == cudaSuccess) err = cudaMemset(rope_counters_, 0, cuda::kRopeTailCounters * sizeof(unsigned));
        }
        if (err != cudaSuccess) {
            release_all();
            (void)cudaGetLastError();
            cuda_fail(err, "creating the cuda backend's event, pinned buffers and counters", __FILE__, __LINE__);
        }
    }
    ~CudaBackend() override { release_all(); }

    dflash_backend kind() const override { return DFLASH_BACKEND_CUDA; }
    dflash_dtype act_dtype() const override { return DFLASH_DTYPE_BF16; }
    dflash_dtype weight_dtype(dflash_dtype) const override { return DFLASH_DTYPE_BF16; }

    void *alloc(size_t bytes) override {
        DFLASH_CUDA_CHECK(cudaSetDevice(device_));
        void *p = nullptr;
        cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
        if (err != cudaSuccess) {
            (void)cudaGetLastError();
            size_t free_b = 0, total_b = 0;
            cudaMemGetInfo(&free_b, &total_b);
            fail(cuda_status(err), "cudaMalloc of ", bytes, " bytes on device ", device_,
                 " failed: ", cudaGetErrorName(err), " (", free_b, " of ", total_b, " bytes free)");
        }
        return p;
    }
    void release(void *ptr) noexcept override {
        if (ptr) cudaFree(ptr);
    }
    // A step's small uploads (tokens, positions, slots) go through the pinned staging buffer: copied there at
    // once (the caller may reuse src on return, as with a pageable copy), then one asynchronous copy from
    // pinned memory, which the driver need not stage itself. (Not measured apart: it landed with session 27's
    // propose changes.) A region is reused only after the stream has passed
    // its copy: every download and synchronize() waits for the whole stream, which frees it all; past its end,
    // the stream is synchronized first. Larger uploads (weights) stay pageable.
    void upload(void *dst, const void *src, size_t bytes) override {
        if (!bytes) return;
        if (bytes <= kStagingBytes && !capturing_) {
            size_t at = (staging_used_ + 15) & ~size_t(15);
            if (at + bytes > kStagingBytes) {
                DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_));
                at = 0;
            }
            unsigned char *stage = static_cast<unsigned char *>(staging_) + at;
            std::memcpy(stage, src, bytes);
            step_timer_.on_upload(stream_);  // DFLASH_STEP_TIMING: a step's arguments mark its entry
            DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, stage, bytes, cudaMemcpyHostToDevice, stream_));
            staging_used_ = at + bytes;
            return;
        }
        DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    }
    void download(void *dst, const void *src, size_t bytes) override {
        if (!bytes) return;
        if (bytes <= kPinnedBytes) {  // the common case: a few tokens
            if (pinned_device_)  // a kernel writes them to the pinned buffer itself (DFLASH_MAPPED_DOWNLOAD)
                cuda::download_to_host(src, bytes, pinned_device_, stream_);
            else
                DFLASH_CUDA_CHECK(cudaMemcpyAsync(pinned_, src, bytes, cudaMemcpyDeviceToHost, stream_));
            step_timer_.on_download_enqueued(stream_);
            DFLASH_CUDA_CHECK(cudaEventRecord(copied_, stream_));
            DFLASH_CUDA_CHECK(cudaEventSynchronize(copied_));
            std::memcpy(dst, pinned_, bytes);
        } else {
            DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
            step_timer_.on_download_enqueued(stream_);
            DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_));
        }
        step_timer_.on_download_done();
        staging_used_ = 0;  // the stream has passed every staged upload
    }
    void copy(void *dst, const void *src, size_t bytes) override {
        if (bytes) DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    void synchronize() override {
        DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_));
        staging_used_ = 0;
    }

    bool graphs_enabled() const override { return graphs_; }
    void begin_capture() override {
        // Thread-local: another thread's unrelated CUDA calls neither break nor join this capture.
        DFLASH_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
        capturing_ = true;
    }
    std::unique_ptr<Graph> end_capture() override {
        capturing_ = false;
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        cudaError_t err = cudaStreamEndCapture(stream_, &graph);
        if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
        if (graph) cudaGraphDestroy(graph);
        if (err != cudaSuccess) {
            (void)cudaGetLastError();
            return nullptr;
        }
        return std::make_unique<CudaGraph>(exec);
    }
    void replay(const Graph &graph) override {
        step_timer_.before_launch(stream_);
        DFLASH_CUDA_CHECK(cudaGraphLaunch(static_cast<const CudaGraph &>(graph).exec, stream_));
        step_timer_.after_launch(stream_);
    }
    uint64_t scratch_epoch() const override { return scratch_epoch_; }

    void convert_rows(const void *src, dflash_dtype src_dtype, bool src_on_device, int64_t n,
                      int64_t width, void *dst) override {
        const int64_t count = n * width;
        if (src_on_device) {
            step_timer_.on_copy(stream_);  // DFLASH_STEP_TIMING: appended rows may be a step's first op
            cuda::convert(src, src_dtype, count, as_bf16(dst), stream_);
            return;
        }
        // Host rows: round to bf16 on the host, then one upload (staged before return).
        std::vector<uint16_t> rows(static_cast<size_t>(count));
        for (int64_t i = 0; i < count; ++i) rows[size_t(i)] = float_to_bf16(load_as_float(src, src_dtype, i));
        upload(dst, rows.data(), rows.size() * sizeof(uint16_t));
    }
    void embed(const int32_t *tokens, int64_t n, WeightView table, float scale, void *out, float *ss_out) override {
        cuda::embed(tokens, n, weight_data(table, "embed"), table.cols, scale, as_bf16(out), stream_, ss_out);
    }
    void rms_norm(const void *x, int64_t rows, int64_t groups, int64_t dim, int64_t ld_x,
                  WeightView w, float eps, void *y, int64_t ld_y) override {
        cuda::rms_norm(as_bf16(x), rows, groups, dim, ld_x, weight_data(w, "rms_norm"), eps,
                       as_bf16(y), ld_y, stream_);
    }
    void gemm(const void *x, int64_t m, int64_t ldx, WeightView w, void *y, int64_t ldy, GemmRows rows,
              GemmFuse fuse) override {
        gemm_into(x, m, ldx, w, y, ldy, rows, fuse, nullptr);
    }
    // DFLASH_FUSED_QKV_ROPE=0 (read once) keeps the rope step as head_norm_rope + kv_write; so does a head_dim the
    // fused kernel (and the rope tail) does not take.
    static bool fused_qkv_rope(int64_t head_dim) {
        static const bool fused = env_switch_on("DFLASH_FUSED_QKV_ROPE");
        return fused && cuda::qkv_norm_rope_write_fused(head_dim);
    }
    // DFLASH_QKV_ROPE_TAIL=1 (read by the constructor; off by default until measured): the rope step in the q/k/v
    // GEMM's epilogue (cuda::RopeTail) where the launch takes it, else the GEMM, then the fused rope kernel.
    void gemm_qkv_rope(const void *x, int64_t m, int64_t ldx, WeightView w, GemmRows rows, GemmFuse fuse,
                       const RopeArgs &r, int64_t heads, int64_t kv_heads, int64_t head_dim, void *k_cache,
                       void *v_cache) override {
        const bool one_row = r.kv == static_cast<char *>(r.q) + size_t(heads * head_dim) * sizeof(bf16) &&
                             r.ldkv == r.ldq && w.rows == (heads + 2 * kv_heads) * head_dim;
        if (!rope_counters_ || !fused_qkv_rope(head_dim) || !one_row || heads > INT32_MAX || kv_heads > INT32_MAX) {
            Backend::gemm_qkv_rope(x, m, ldx, w, rows, fuse, r, heads, kv_heads, head_dim, k_cache, v_cache);
            return;
        }
        const cuda::RopeTail tail{static_cast<unsigned *>(rope_counters_),
                                  r.q_norm ? weight_data(*r.q_norm, "gemm_qkv_rope") : nullptr,
                                  r.k_norm ? weight_data(*r.k_norm, "gemm_qkv_rope") : nullptr,
                                  r.positions, r.slots, r.inv_freq, as_bf16(k_cache), as_bf16(v_cache), r.eps,
                                  r.attention_factor, int(heads), int(kv_heads), int(head_dim)};
        gemm_into(x, m, ldx, w, r.q, r.ldq, rows, fuse, &tail);
    }
    // gemm, and with tail the rope step after it (cuda::gemm's tail; here in its own kernel where the GEMM is
    // not cuda::gemm's).
    void gemm_into(const void *x, int64_t m, int64_t ldx, WeightView w, void *y, int64_t ldy, GemmRows rows,
                   GemmFuse fuse, const cuda::RopeTail *tail) {
        auto rope_after = [&]() {
            if (tail) cuda::qkv_norm_rope_write(as_bf16(y), ldy, m, *tail, stream_);
        };
        const bf16 *wd = weight_data(w, "gemm", true);
        if (fuse.accumulate && ldy != w.rows)
            fail(DFLASH_STATUS_INTERNAL, "gemm: accumulate needs ldy == N (", ldy, " != ", w.rows, ")");
        const bool wide = takes_wide(rows, x, m, ldx, wd, w);
        const bool unfuse = (fuse.norm_eps > 0.f && (!fold_norm_in(kFoldGemm) || !fuse.ss_in || fuse.ss_out)) ||
                            (fuse.accumulate && !fold_add_in());  // (one kernel norms or sums, not both)
        if ((fuse.any() || fuse.ss_out) &&
            (wide || unfuse || !cuda::gemm_fuse_fits(as_bf16(x), ldx, wd, w.tiled, w.cols))) {
            // The same ops unfused: the unit-weight norm into scratch (the weight is folded), the product
            // into scratch, then the residual add, then the sums of squares asked for.
            const void *in = normed_input(x, m, ldx, w.cols, fuse.norm_eps, &ldx);
            if (!fuse.accumulate) {
                gemm(in, m, ldx, w, y, ldy, rows, GemmFuse{});
            } else {
                void *product = grow(product_scratch_, size_t(m * w.rows) * sizeof(bf16));
                gemm(in, m, ldx, w, product, w.rows, rows, GemmFuse{});
                cuda::add(as_bf16(y), as_bf16(product), m * w.rows, stream_);
            }
            if (fuse.ss_out) cuda::row_sq_parts(as_bf16(y), m, w.rows, ldy, fuse.ss_out, stream_);
            rope_after();
            return;
        }
        if (wide) {
            cuda::gemm_wide(as_bf16(x), m, ldx, wd, w.tiled, w.rows, w.cols, as_bf16(y), ldy, stream_);
            rope_after();
        } else {
            cuda::gemm(as_bf16(x), m, ldx, wd, w.tiled, w.rows, w.cols, as_bf16(y), ldy, stream_, fuse, tail);
        }
    }
    // DFLASH_GEMM_FOLD_NORM=MASK / DFLASH_GEMM_FOLD_ADD=0 (read once): the folded model with its norms or its
    // residual adds as separate kernels. A folded norm (the weight in the GEMM's columns either way) is taken
    // by the GEMM itself (GemmFuse::ss_in, kNorm) for the ops in MASK, else by the unit-weight norm kernel
    // before a plain GEMM: 1 the norming GEMMs (the q/k/v projections), 2 the norming SwiGLU (gate/up); 0
    // neither. The choice depends on the op, never on the row count, so rows agree at any M (DESIGN §5).
    // Default 0 (session 26 on the H200, `bench.py --variants`, 2 rounds, against 3, both folded: decode
    // 0.981x, verify 0.967x, propose 8B 0.985x, 4B 0.989x the time; mask 1: decode 0.975x, verify 0.975x): the
    // kNorm kernels cost more than a norm kernel before the plain ones (at 16 rows the plain q/k/v streams x in
    // its ring, the kNorm one lost with it, session 24; the persistent gate/up took 4 (1 row) to 8.6 us (16 rows) more per layer).
    // Session 48 on the H100, under RingTma (DFLASH_GEMM_X_RING=95) and with the drafter folding like the target,
    // against the default: 3 made verify 1.008x, decode 1.006x, the proposes 1.003-1.022x the time; 1 verify
    // 0.996x / 1.003x (two runs), decode 0.995x / 0.994x, the 4B propose 1.006x / 1.008x, 8B 1.017x / 1.008x.
    static constexpr int kFoldGemm = 1, kFoldSwiGLU = 2;
    static bool fold_norm_in(int op) {
        static const EnvInt mask = env_int("DFLASH_GEMM_FOLD_NORM", 0, 0, 3);
        return (env_value(mask, "DFLASH_GEMM_FOLD_NORM", "is not a mask of 1 (GEMMs) and 2 (SwiGLU)") & op) != 0;
    }
    bool reads_norm_stats(NormOp op) const override {
        return folds_norms() && fold_norm_in(op == NormOp::Gemm ? kFoldGemm : kFoldSwiGLU);
    }
    static bool fold_add_in() {
        static const bool on = env_switch_on("DFLASH_GEMM_FOLD_ADD");
        return on;
    }
    // x's rows RMS-normed with unit weight into scratch (a folded norm where the GEMM cannot fold it), or
    // x itself where eps is 0; *ld becomes the rows' stride.
    const void *normed_input(const void *x, int64_t m, int64_t ldx, int64_t K, float eps, int64_t *ld) {
        if (!(eps > 0.f)) return x;
        void *normed = grow(norm_scratch_, size_t(m * K) * sizeof(bf16));
        cuda::rms_norm(as_bf16(x), m, 1, K, ldx, nullptr, eps, as_bf16(normed), K, stream_);
        *ld = K;
        return normed;
    }
    // On by default; DFLASH_FUSED_NORM=0 (read once) keeps the norm kernels. Session 14's first version
    // (sums of squares by two more mma per k step) made verify 1.05x, decode 1.07x and propose 1.03x
    // slower; this one takes them from the producer's epilogue (GemmFuse::ss_out / ss_in). Session 15 on
    // the H200 against DFLASH_FUSED_NORM=0: decode 0.977x and 0.983x (two runs), verify 0.994x, propose
    // 8B 0.991x, 4B 1.013x. Since session 26 the norms themselves run as unit-weight norm kernels by default
    // (fold_norm_in: the weights stay folded, the residual adds in o_proj / down); against DFLASH_FUSED_NORM=0
    // that is decode 0.993x, verify 0.995x, propose 1.001-1.005x (session 26 run 5, 2 rounds).
    bool folds_norms() const override {
        static const bool on = env_switch_on("DFLASH_FUSED_NORM");
        return on && cuda::fused_norm_supported();
    }
    void fold_norm(WeightView w, WeightView g) override {
        if (w.tiled) fail(DFLASH_STATUS_INTERNAL, "fold_norm: the weight is tiled (fold before tiling)");
        if (g.cols != w.cols) fail(DFLASH_STATUS_INTERNAL, "fold_norm: ", g.cols, " norm weights for ", w.cols, " columns");
        cuda::fold_norm(const_cast<bf16 *>(weight_data(w, "fold_norm")), w.rows, w.cols, weight_data(g, "fold_norm"),
                        stream_);
        // Weights must be constant while kernels run (a GEMM under PDL reads them before its wait).
        DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    // GemmRows::Wide calls take the wide GEMM (gemm_wide.cu) where it fits; DFLASH_GEMM_WIDE=0 keeps
    // them on the small-M kernels (an A/B switch).
    static bool takes_wide(GemmRows rows, const void *x, int64_t m, int64_t ldx, const bf16 *wd,
                           const WeightView &w) {
        static const bool on = env_switch_on("DFLASH_GEMM_WIDE");
        return on && rows == GemmRows::Wide && cuda::gemm_wide_fits(as_bf16(x), m, ldx, wd, w.tiled, w.cols);
    }
    // On by default (measured on the H200: decode 8% faster, verify and propose the same or faster);
    // DFLASH_GEMM_TILED=0 keeps row-major weights (an A/B switch).
    bool tiles_gemm_weights() const override {
        static const bool wanted = env_switch_on("DFLASH_GEMM_TILED");
        return wanted && cuda::tiled_gemm_supported();
    }
    void tile_gemm_weight(const WeightView &src, void *dst) override {
        cuda::tile_weight(weight_data(src, "tile_gemm_weight"), src.rows, src.cols, as_bf16(dst), stream_);
    }
    void rope(void *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
              const int32_t *positions, const float *inv_freq, float attention_factor) override {
        cuda::rope(as_bf16(x), rows, heads, head_dim, ld, positions, inv_freq, attention_factor, stream_);
    }
    void kv_write(const void *k, const void *v, int64_t rows, int64_t ld, const int32_t *slots,
                  int64_t kv_width, void *k_cache, void *v_cache) override {
        cuda::kv_write(as_bf16(k), as_bf16(v), rows, ld, slots, kv_width, as_bf16(k_cache),
                       as_bf16(v_cache), stream_);
    }
    void attention(const void *q, int64_t ldq, int64_t nq, const int32_t *q_positions, int64_t n_heads,
                   int64_t n_kv_heads, int64_t head_dim, float scale, AttentionMask mask,
                   const PagedKeys &keys, void *out) override {
        void *scratch = grow(attention_scratch_, cuda::attention_scratch_bytes(
                                                     nq, n_heads, head_dim, n_kv_heads, keys));
        cuda::attention(as_bf16(q), ldq, nq, q_positions, n_heads, n_kv_heads, head_dim, scale, mask,
                        keys, scratch, as_bf16(out), stream_);
    }
    void add_rms_norm(void *x, const void *res, int64_t rows, int64_t dim, WeightView w, float eps,
                      void *y) override {
        cuda::add_rms_norm(as_bf16(x), as_bf16(res), rows, dim, weight_data(w, "add_rms_norm"), eps,
                           as_bf16(y), stream_);
    }
    void gemm_swiglu(const void *x, int64_t m, int64_t ldx, WeightView gate_up, int64_t inter,
                     void *gate_up_scratch, void *out, GemmRows rows, GemmFuse fuse) override {
        if (gate_up.rows != 2 * inter)
            fail(DFLASH_STATUS_INTERNAL, "gemm_swiglu: ", gate_up.rows, " weight rows for intermediate ",
                 inter);
        if (fuse.accumulate) fail(DFLASH_STATUS_INTERNAL, "gemm_swiglu does not accumulate");
        static const bool fused = env_switch_on("DFLASH_FUSED_SWIGLU");
        const bf16 *w = weight_data(gate_up, "gemm_swiglu", true);
        if (fused && takes_wide(rows, x, m, ldx, w, gate_up)) {
            const void *in = normed_input(x, m, ldx, gate_up.cols, fuse.norm_eps, &ldx);
            cuda::gemm_wide_swiglu(as_bf16(in), m, ldx, w, gate_up.tiled, inter, gate_up.cols, as_bf16(out), inter,
                                   stream_);
            return;
        }
        if (fuse.norm_eps > 0.f && (!fold_norm_in(kFoldSwiGLU) || !fuse.ss_in)) {  // norm first, then the plain kernel
            x = normed_input(x, m, ldx, gate_up.cols, fuse.norm_eps, &ldx);
            fuse = GemmFuse{};
        }
        if (!fused || !cuda::gemm_swiglu(as_bf16(x), m, ldx, w, gate_up.tiled, inter, gate_up.cols, as_bf16(out),
                                         inter, stream_, fuse))
            Backend::gemm_swiglu(x, m, ldx, gate_up, inter, gate_up_scratch, out, rows, fuse);
    }
    void qkv_norm_rope_write(void *q, int64_t ldq, void *kv, int64_t ldkv, int64_t rows, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, const WeightView *q_norm,
                             const WeightView *k_norm, float eps, const int32_t *positions,
                             const float *inv_freq, float attention_factor, const int32_t *slots,
                             void *k_cache, void *v_cache) override {
        if (!fused_qkv_rope(head_dim)) {
            Backend::qkv_norm_rope_write(q, ldq, kv, ldkv, rows, heads, kv_heads, head_dim, q_norm, k_norm,
                                         eps, positions, inv_freq, attention_factor, slots, k_cache, v_cache);
            return;
        }
        const bf16 *wq = q_norm ? weight_data(*q_norm, "qkv_norm_rope_write") : nullptr;
        const bf16 *wk = k_norm ? weight_data(*k_norm, "qkv_norm_rope_write") : nullptr;
        cuda::qkv_norm_rope_write(as_bf16(q), ldq, as_bf16(kv), ldkv, rows, heads, kv_heads, head_dim, wq, wk,
                                  eps, positions, inv_freq, attention_factor, slots, as_bf16(k_cache),
                                  as_bf16(v_cache), stream_);
    }
    void kv_norm_rope_write_layers(void *kv, int64_t ldkv, int64_t layer_ld, int64_t layers, int64_t rows,
                                   int64_t kv_heads, int64_t head_dim, const WeightView *const *k_norms, float eps,
                                   const int32_t *positions, const float *inv_freq, float attention_factor,
                                   const int32_t *slots, void *const *k_caches, void *const *v_caches) override {
        if (!fused_qkv_rope(head_dim)) {
            Backend::kv_norm_rope_write_layers(kv, ldkv, layer_ld, layers, rows, kv_heads, head_dim, k_norms, eps,
                                               positions, inv_freq, attention_factor, slots, k_caches, v_caches);
            return;
        }
        for (int64_t l0 = 0; l0 < layers; l0 += cuda::kMaxRopeLayers) {  // kMaxRopeLayers a launch
            const int n = int(std::min<int64_t>(cuda::kMaxRopeLayers, layers - l0));
            cuda::RopeLayers per_layer{};
            for (int i = 0; i < n; ++i) {
                const WeightView *w = k_norms ? k_norms[l0 + i] : nullptr;
                per_layer.k_norm[i] = w ? weight_data(*w, "kv_norm_rope_write_layers") : nullptr;
                per_layer.k_cache[i] = as_bf16(k_caches[l0 + i]);
                per_layer.v_cache[i] = as_bf16(v_caches[l0 + i]);
            }
            cuda::kv_norm_rope_write_layers(as_bf16(kv) + l0 * layer_ld, ldkv, layer_ld, n, rows, kv_heads, head_dim,
                                            per_layer, eps, positions, inv_freq, attention_factor, slots, stream_);
        }
    }
    void head_norm_rope(void *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
                        const WeightView *w, float eps, const int32_t *positions,
                        const float *inv_freq, float attention_factor) override {
        cuda::head_norm_rope(as_bf16(x), rows, heads, head_dim, ld,
                             w ? weight_data(*w, "head_norm_rope") : nullptr, eps, positions, inv_freq,
                             attention_factor, stream_);
    }
    void add(void *y, const void *x, int64_t n) override {
        cuda::add(as_bf16(y), as_bf16(x), n, stream_);
    }
    void swiglu(const void *gate_up, int64_t rows, int64_t inter, void *out) override {
        cuda::swiglu(as_bf16(gate_up), rows, inter, as_bf16(out), stream_);
    }
    void logits_argmax(const void *h, int64_t m, WeightView lm_head, float multiplier,
                       float softcap, int32_t *tokens) override {
        void *partial = grow(argmax_scratch_, cuda::logits_argmax_scratch_bytes(m, lm_head.rows));
        cuda::logits_argmax(as_bf16(h), m, weight_data(lm_head, "logits_argmax", true), lm_head.tiled,
                            lm_head.rows, lm_head.cols, multiplier, softcap, partial, tokens, stream_);
    }
    void copy_rows(const void *src, int64_t ld_src, int64_t rows, int64_t width, void *dst,
                   int64_t ld_dst) override {
        cuda::copy_rows(as_bf16(src), ld_src, rows, width, as_bf16(dst), ld_dst, stream_);
    }
    void logits(const void *h, int64_t m, WeightView lm_head, float multiplier, float softcap,
                float *out) override {
        cuda::logits(as_bf16(h), m, weight_data(lm_head, "logits", true), lm_head.tiled, lm_head.rows,
                     lm_head.cols, multiplier, softcap, out, stream_);
    }
    void sampling_probs(float *rows, int64_t m, int64_t vocab, float temperature, float top_p,
                        int32_t top_k) override {
        cuda::sampling_probs(rows, m, vocab, temperature, top_p, top_k, stream_);
    }
    void sample_rows(const float *probs, int64_t m, int64_t vocab, RngKey key, uint32_t first_row,
                     uint32_t purpose, int32_t *out) override {
        cuda::sample_rows(probs, m, vocab, key, first_row, purpose, out, stream_);
    }
    void greedy_accept(const int32_t *tokens, const int32_t *posterior, int64_t n,
                       int32_t *out) override {
        cuda::greedy_accept(tokens, posterior, n, out, stream_);
    }
    void rejection_accept(const float *p, const int32_t *tokens, const float *q, int64_t n,
                          int64_t vocab, RngKey key, int32_t *out) override {
        cuda::rejection_accept(p, tokens, q, n, vocab, key, out, stream_);
    }

private:
    static constexpr size_t kPinnedBytes = 1 << 16;
    static constexpr size_t kStagingBytes = 1 << 16;  // upload's pinned staging

    // Grow-only scratch: first use (warm-up) allocates, steady state reuses. Graphs captured
    // before a reallocation point at the old buffer: the epoch tells their owners.
    void *grow(DeviceBuffer &buffer, size_t bytes) {
        if (buffer.bytes() < bytes) {
            if (capturing_)
                fail(DFLASH_STATUS_INTERNAL, "cuda: op scratch must grow to ", bytes,
                     " bytes while a graph is recorded (the eager warm-up should have sized it)");
            buffer.reset();  // cudaFree waits for kernels still using it
            buffer = DeviceBuffer(this, bytes);
            ++scratch_epoch_;
        }
        return buffer.get();
    }

    void release_all() noexcept {
        cudaSetDevice(device_);
        argmax_scratch_.reset();
        attention_scratch_.reset();
        norm_scratch_.reset();
        product_scratch_.reset();
        if (stream_) cudaStreamSynchronize(stream_);  // no staged upload still reads staging_
        if (pinned_) cudaFreeHost(pinned_);
        if (staging_) cudaFreeHost(staging_);
        if (copied_) cudaEventDestroy(copied_);
        if (owns_stream_ && stream_) cudaStreamDestroy(stream_);
        if (rope_counters_) cudaFree(rope_counters_);
        pinned_ = pinned_device_ = staging_ = rope_counters_ = nullptr;
        copied_ = nullptr;
        stream_ = nullptr;
    }

    int device_ = 0;
    bool graphs_ = true;
    bool capturing_ = false;
    uint64_t scratch_epoch_ = 0;
    cudaStream_t stream_ = nullptr;
    bool owns_stream_ = false;
    cudaEvent_t copied_ = nullptr;
    void *pinned_ = nullptr;
    void *pinned_device_ = nullptr;  // pinned_'s device address (downloads by kernel), or null (by copy)
    void *staging_ = nullptr;
    size_t staging_used_ = 0;
    void *rope_counters_ = nullptr;  // DFLASH_QKV_ROPE_TAIL: cuda::kRopeTailCounters zeroed words (gemm_qkv_rope)
    cuda::StepTimer step_timer_;  // DFLASH_STEP_TIMING=1 only (step_timing.cuh)
    DeviceBuffer argmax_scratch_, attention_scratch_;
    DeviceBuffer norm_scratch_, product_scratch_;  // unfused GemmFuse: the normed x, the product
};

}  // namespace

bool cuda_compiled() { return true; }

bool pdl_enabled() {
    static const bool allowed = env_switch_on("DFLASH_PDL");
    static signed char by_device[64] = {};  // 0 unknown, 1 yes, -1 no
    if (!allowed) return false;
    int device = 0;
    DFLASH_CUDA_CHECK(cudaGetDevice(&device));
    if (device < 0 || device >= 64) return false;
    if (by_device[device] == 0) {
        int major = 0;
        DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        by_device[device] = major >= 9 ? 1 : -1;
    }
    return by_device[device] > 0;
}

int smem_carveout() {
    static const EnvInt setting = env_int("DFLASH_SMEM_CARVEOUT", -1, -1, 100);
    return int(env_value(setting, "DFLASH_SMEM_CARVEOUT", "is not a carveout percentage (-1 to 100)"));
}

const char *cuda_arch_list() { return DFLASH_CUDA_ARCH_LIST; }

int cuda_device_count() {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        fail(DFLASH_STATUS_NO_DEVICE, "no CUDA device: cudaGetDeviceCount failed with ",
             cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
    }
    return count;
}

std::shared_ptr<Backend> make_cuda_backend(int device, uint64_t stream, bool graphs) {
    const int count = cuda_device_count();
    if (count == 0) fail(DFLASH_STATUS_NO_DEVICE, "no CUDA device: cudaGetDeviceCount returned 0");
    if (device < 0 || device >= count)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "CUDA device ", device, " does not exist (", count,
             " visible)");
    return std::make_shared<CudaBackend>(device, stream, graphs);
}

}  // namespace dflash
