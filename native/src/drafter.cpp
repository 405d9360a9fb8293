// drafter.cpp: config validation, weights, the paged KV bookkeeping and the propose pipeline.
// See drafter.hpp for the data flow; DESIGN §1 for the semantics this reproduces.
#include "drafter.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace dflash {
namespace {

constexpr const char *kParams = "drafter params";

std::string layer_name(int i, const char *suffix) {
    return cat("layers.", i, ".", suffix);
}

}  // namespace

Drafter::Drafter(std::shared_ptr<Backend> backend, const dflash_drafter_params &p,
                 std::shared_ptr<const SharedHead> shared)
    : backend_(std::move(backend)), p_(p), weights_(backend_), shared_(std::move(shared)) {
    if (const char *missing = backend_->missing_ops())
        fail(DFLASH_STATUS_NOT_SUPPORTED, "the ",
             backend_->kind() == DFLASH_BACKEND_CUDA ? "cuda" : "host",
             " backend cannot run a drafter yet (missing: ", missing, "); use the host backend");
    check_range(kParams, "num_layers", p.num_layers, 1, DFLASH_MAX_LAYERS);
    check_range(kParams, "hidden_size", p.hidden_size, 1, 1 << 20);
    check_range(kParams, "intermediate_size", p.intermediate_size, 1, 1 << 22);
    check_range(kParams, "num_heads", p.num_heads, 1, 1024);
    check_range(kParams, "num_kv_heads", p.num_kv_heads, 1, p.num_heads);
    if (p.num_heads % p.num_kv_heads)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "drafter params: num_heads ", p.num_heads,
             " is not a multiple of num_kv_heads ", p.num_kv_heads);
    check_range(kParams, "head_dim", p.head_dim, 2, 1024);
    if (p.head_dim % 2)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "drafter params: head_dim ", p.head_dim,
             " must be even (rotate-half RoPE)");
    check_range(kParams, "vocab_size", p.vocab_size, 1, INT32_MAX);
    if (!(p.rms_norm_eps > 0))
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "drafter params: rms_norm_eps ", p.rms_norm_eps,
             " must be > 0");
    check_range(kParams, "max_position_embeddings", p.max_position_embeddings, 1, INT32_MAX);
    validate_rope(p.rope);
    check_range(kParams, "sliding_window", p.sliding_window, 0, INT32_MAX);
    check_range(kParams, "is_causal", p.is_causal, -1, 1);
    for (int i = 0; i < p.num_layers; ++i)
        if (p.layer_types[i] != DFLASH_LAYER_FULL_ATTENTION &&
            p.layer_types[i] != DFLASH_LAYER_SLIDING_ATTENTION)
            fail(DFLASH_STATUS_INVALID_ARGUMENT, "drafter params: layer_types[", i, "] = ",
                 int(p.layer_types[i]), " is not a dflash_layer_type");
    check_range(kParams, "block_size", p.block_size, 2, 256);
    if (p.mask_token_id < 0 || p.mask_token_id >= p.vocab_size)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "drafter params: mask_token_id ", p.mask_token_id,
             " is outside the vocabulary [0, ", p.vocab_size, ")");
    check_range(kParams, "num_target_layer_ids", p.num_target_layer_ids, 1, DFLASH_MAX_TARGET_LAYER_IDS);
    check_range(kParams, "num_target_layers", p.num_target_layers, 0, 1 << 16);
    for (int i = 0; i < p.num_target_layer_ids; ++i) {
        const int32_t id = p.target_layer_ids[i];
        if (id < 0 || (p.num_target_layers > 0 && id >= p.num_target_layers))
            fail(DFLASH_STATUS_INVALID_ARGUMENT, "drafter params: target_layer_ids[", i, "] = ", id,
                 " is not a layer of a ", p.num_target_layers, "-layer target");
    }
    check_range(kParams, "target_hidden_size", p.target_hidden_size, 0, 1 << 20);
    if (!std::isfinite(p.input_embedding_scale) || !std::isfinite(p.output_multiplier))
        fail(DFLASH_STATUS_INVALID_ARGUMENT,
             "drafter params: input_embedding_scale and output_multiplier must be finite");
    if (!(p.final_logit_softcapping >= 0))
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "drafter params: final_logit_softcapping ",
             p.final_logit_softcapping, " must be >= 0 (0 = none)");
    check_range(kParams, "tie_word_embeddings", p.tie_word_embeddings, 0, 1);
    check_range(kParams, "max_batch", p.max_batch, 1, 1 << 16);
    check_range(kParams, "max_seq_len", p.max_seq_len, 1, 1 << 28);
    check_range(kParams, "ctx_window", p.ctx_window, 0, 1 << 28);
    check_range(kParams, "ctx_chunk_rows", p.ctx_chunk_rows, 0, 1 << 20);

    const int64_t H = p.hidden_size, I = p.intermediate_size;
    q_width_ = int64_t(p.num_heads) * p.head_dim;
    kv_width_ = int64_t(p.num_kv_heads) * p.head_dim;
    fused_kv_width_ = int64_t(p.num_layers) * 2 * kv_width_;
    if (p_.target_hidden_size == 0) p_.target_hidden_size = p.hidden_size;
    feature_width_ = int64_t(p.num_target_layer_ids) * p_.target_hidden_size;
    gamma_ = p.block_size;
    chunk_rows_ = p.ctx_chunk_rows > 0 ? p.ctx_chunk_rows : std::max(64, gamma_);
    const int64_t live_ctx = p.ctx_window > 0 ? std::min(p.ctx_window, p.max_seq_len)
                                              : p.max_seq_len;
    blocks_per_seq_ = int32_t(ceil_div(live_ctx + gamma_, DFLASH_KV_BLOCK_SIZE));
    ring_slots_ = blocks_per_seq_ * DFLASH_KV_BLOCK_SIZE;
    act_size_ = dtype_size(backend_->act_dtype());
    rope_ = compute_rope(p.rope, p.head_dim, p.max_position_embeddings);

    auto &w = weights_;
    w.expect("fc.weight", {H, feature_width_});
    w.expect("hidden_norm.weight", {H});
    w.expect("norm.weight", {H});
    if (!shared_) {  // else the target's, shared in memory
        w.expect("embed_tokens.weight", {p.vocab_size, H});
        if (!p.tie_word_embeddings) w.expect("lm_head.weight", {p.vocab_size, H});
    }
    for (int i = 0; i < p.num_layers; ++i) {
        w.expect(layer_name(i, "input_layernorm.weight"), {H});
        w.expect(layer_name(i, "post_attention_layernorm.weight"), {H});
        w.expect(layer_name(i, "self_attn.q_proj.weight"), {q_width_, H});
        w.expect(layer_name(i, "self_attn.k_proj.weight"), {kv_width_, H});
        w.expect(layer_name(i, "self_attn.v_proj.weight"), {kv_width_, H});
        w.expect(layer_name(i, "self_attn.o_proj.weight"), {H, q_width_});
        w.expect(layer_name(i, "self_attn.q_norm.weight"), {p.head_dim});
        w.expect(layer_name(i, "self_attn.k_norm.weight"), {p.head_dim});
        w.expect(layer_name(i, "mlp.gate_proj.weight"), {I, H});
        w.expect(layer_name(i, "mlp.up_proj.weight"), {I, H});
        w.expect(layer_name(i, "mlp.down_proj.weight"), {H, I});
    }
}

Drafter::~Drafter() = default;

void Drafter::set_tensor(const std::string &raw_name, dflash_dtype dtype, int32_t ndim,
                         const int64_t *shape, const void *data) {
    if (finalized_)
        fail(DFLASH_STATUS_INVALID_STATE, "tensor '", raw_name,
             "' given after dflash_drafter_finalize");
    const bool head = raw_name.find("embed_tokens") != std::string::npos ||
                      raw_name.find("lm_head") != std::string::npos;
    weights_.set(raw_name, dtype, ndim, shape, data,
                 shared_ && head ? " (the drafter shares the target's embed_tokens and lm_head)"
                 : p_.tie_word_embeddings && head ? " (tie_word_embeddings: lm_head is embed_tokens)"
                 : "");
}

WeightView Drafter::weight(const std::string &name) const { return weights_.view(name); }

WeightView Drafter::embed() const {
    return shared_ ? shared_->store->view(shared_->embed_name) : weights_.view("embed_tokens.weight");
}

WeightView Drafter::lm_head() const {
    if (shared_) return shared_->store->view(shared_->lm_head_name);
    return weights_.view(p_.tie_word_embeddings ? "embed_tokens.weight" : "lm_head.weight");
}

void Drafter::finalize() {
    if (finalized_) fail(DFLASH_STATUS_INVALID_STATE, "drafter is already finalized");
    weights_.require_complete();

    // Everything below is built into locals and committed at the end, so a failure (out of
    // memory) leaves the drafter exactly as before: unfinalized, no partial allocation.
    const int L = p_.num_layers;
    std::vector<std::string> kv_names;
    for (int i = 0; i < L; ++i) {
        kv_names.push_back(layer_name(i, "self_attn.k_proj.weight"));
        kv_names.push_back(layer_name(i, "self_attn.v_proj.weight"));
    }
    WeightStore::Tensor fused_kv = weights_.fuse_rows(kv_names);
    // The block's q and K/V come from the same normed rows: one GEMM over [q_proj; k_proj; v_proj] per layer
    // (one launch fewer per layer, at 2 kv_width x H more weights per layer than fused_kv alone);
    // DFLASH_DRAFTER_FUSED_QKV=0 (read at each finalize, so tests cover both) keeps two GEMMs, as does a
    // checkpoint whose q_proj dtype differs from its k_proj / v_proj (tensors may differ in dtype; fused rows
    // may not).
    const char *fuse_env = std::getenv("DFLASH_DRAFTER_FUSED_QKV");
    bool fuse_qkv = !(fuse_env && fuse_env[0] == '0');
    for (int i = 0; fuse_qkv && i < L; ++i)
        fuse_qkv = weights_.view(layer_name(i, "self_attn.q_proj.weight")).dtype ==
                   weights_.view(layer_name(i, "self_attn.k_proj.weight")).dtype;
    std::vector<WeightStore::Tensor> qkv;
    for (int i = 0; fuse_qkv && i < L; ++i)
        qkv.push_back(weights_.fuse_rows({layer_name(i, "self_attn.q_proj.weight"),
                                          layer_name(i, "self_attn.k_proj.weight"),
                                          layer_name(i, "self_attn.v_proj.weight")}));
    std::vector<WeightStore::Tensor> gate_up;
    for (int i = 0; i < L; ++i)
        gate_up.push_back(weights_.fuse_rows({layer_name(i, "mlp.gate_proj.weight"),
                                              layer_name(i, "mlp.up_proj.weight")}));
    // Where the backend folds norms, each layer's post-attention norm goes into its gate/up weight (see
    // Target::finalize). The norms before the K/V projections fold too where the block's q/k/v weight is a copy
    // of its own (fuse_qkv: then fused_kv serves the context rows alone) and a norming GEMM takes its rows' sums
    // of squares from the GEMM before it (Backend::reads_norm_stats): each layer's input norm into its q/k/v
    // weight (the sums from the down before it), hidden_norm into fused_kv (the sums from fc), so the norm kernels
    // there go away, as in the target. Elsewhere they stay kernels (a folded weight would only trade each for the
    // unit-weight norm kernel before a plain GEMM).
    const bool fold = backend_->folds_norms();
    const bool fold_input = fold && fuse_qkv && backend_->reads_norm_stats(Backend::NormOp::Gemm);
    for (int i = 0; fold && i < L; ++i)
        backend_->fold_norm(gate_up[size_t(i)].view(), weights_.view(layer_name(i, "post_attention_layernorm.weight")));
    for (int i = 0; fold_input && i < L; ++i)
        backend_->fold_norm(qkv[size_t(i)].view(), weights_.view(layer_name(i, "input_layernorm.weight")));
    if (fold_input) backend_->fold_norm(fused_kv.view(), weights_.view("hidden_norm.weight"));
    // GEMM weights in the backend's streaming layout (a no-op on the host; see Target::finalize).
    if ((2 * kv_width_) % kTileRows == 0)  // propose slices it by layer (2 * kv_width rows)
        fused_kv = weights_.tiled_for_gemm(std::move(fused_kv));
    for (auto &t : gate_up) t = weights_.tiled_for_gemm(std::move(t));
    for (auto &t : qkv) t = weights_.tiled_for_gemm(std::move(t));
    weights_.tile_for_gemm("fc.weight");
    for (int i = 0; i < L; ++i) {
        for (const char *n : {"self_attn.o_proj.weight", "mlp.down_proj.weight"})
            weights_.tile_for_gemm(layer_name(i, n));
        if (!fuse_qkv) weights_.tile_for_gemm(layer_name(i, "self_attn.q_proj.weight"));
    }
    if (!shared_ && !p_.tie_word_embeddings) weights_.tile_for_gemm("lm_head.weight");  // tied: see Target

    const int32_t total_blocks = p_.max_batch * blocks_per_seq_ + 1;
    const size_t cache_bytes =
        size_t(total_blocks) * DFLASH_KV_BLOCK_SIZE * size_t(kv_width_) * act_size_;
    std::vector<DeviceBuffer> k_cache, v_cache;
    for (int i = 0; i < L; ++i) {
        k_cache.emplace_back(backend_.get(), cache_bytes);
        v_cache.emplace_back(backend_.get(), cache_bytes);
    }
    DeviceBuffer inv_freq(backend_.get(), rope_.inv_freq.size() * sizeof(float));
    backend_->upload(inv_freq.get(), rope_.inv_freq.data(), inv_freq.bytes());

    Backend *b = backend_.get();
    const size_t g = size_t(gamma_), c = size_t(chunk_rows_), a = act_size_;
    const size_t H = size_t(p_.hidden_size), I = size_t(p_.intermediate_size);
    // Fused, q_ holds each row's q then its K/V (the qkv GEMM's output) and kv_ is not needed.
    const size_t qkv_cols = size_t(q_width_ + (fuse_qkv ? 2 * kv_width_ : 0));
    DeviceBuffer x(b, g * H * a), xn(b, g * H * a), q(b, g * qkv_cols * a),
        kv(fuse_qkv ? nullptr : b, fuse_qkv ? 0 : g * 2 * size_t(kv_width_) * a), attn(b, g * size_t(q_width_) * a),
        gu(b, g * 2 * I * a), mlp(b, g * I * a), ctx_h(b, c * H * a),
        ctx_kv(b, c * size_t(fused_kv_width_) * a),
        step(b, (4 * g + 2 * c + 2) * sizeof(int32_t)),
        probs(b, g * size_t(p_.vocab_size) * sizeof(float)),
        ss(fold ? b : nullptr,
           fold ? (fold_input ? std::max(g, c) : g) * size_t(ss_parts(p_.hidden_size)) * sizeof(float) : 0);

    // Commit.
    fused_kv_ = std::move(fused_kv);
    fused_gate_up_ = std::move(gate_up);
    fused_qkv_ = std::move(qkv);
    k_cache_ = std::move(k_cache);
    v_cache_ = std::move(v_cache);
    inv_freq_ = std::move(inv_freq);
    x_ = std::move(x); xn_ = std::move(xn); q_ = std::move(q); kv_ = std::move(kv);
    attn_ = std::move(attn); gate_up_ = std::move(gu); mlp_ = std::move(mlp);
    ctx_h_ = std::move(ctx_h); ctx_kv_ = std::move(ctx_kv); step_i32_ = std::move(step);
    probs_ = std::move(probs);
    ss_ = std::move(ss);
    folded_ = fold;
    fold_input_ = fold_input;
    for (const auto &n : kv_names) weights_.erase(n);
    layers_.clear();
    for (int i = 0; i < L; ++i) {
        weights_.erase(layer_name(i, "mlp.gate_proj.weight"));
        weights_.erase(layer_name(i, "mlp.up_proj.weight"));
        Layer layer;
        layer.input_norm = weight(layer_name(i, "input_layernorm.weight"));
        layer.post_norm = weight(layer_name(i, "post_attention_layernorm.weight"));
        if (fused_qkv_.empty()) {
            layer.q_proj = weight(layer_name(i, "self_attn.q_proj.weight"));
        } else {
            weights_.erase(layer_name(i, "self_attn.q_proj.weight"));
            layer.qkv_proj = fused_qkv_[size_t(i)].view();
        }
        layer.q_norm = weight(layer_name(i, "self_attn.q_norm.weight"));
        layer.k_norm = weight(layer_name(i, "self_attn.k_norm.weight"));
        layer.o_proj = weight(layer_name(i, "self_attn.o_proj.weight"));
        layer.gate_up = fused_gate_up_[i].view();
        layer.down = weight(layer_name(i, "mlp.down_proj.weight"));
        const bool sliding = p_.layer_types[i] == DFLASH_LAYER_SLIDING_ATTENTION;
        layer.causal = p_.is_causal < 0 ? sliding : p_.is_causal == 1;
        layer.window = sliding ? p_.sliding_window : 0;
        layers_.push_back(layer);
    }
    pool_.reset(total_blocks);
    finalized_ = true;
}

void Drafter::require_finalized(const char *what) const {
    if (!finalized_)
        fail(DFLASH_STATUS_INVALID_STATE, what, " needs a finalized drafter (call "
             "dflash_drafter_finalize after setting every tensor)");
}

dflash_pool_stats Drafter::pool_stats(int32_t live_sequences) const {
    require_finalized("pool_stats");
    return pool_.stats(blocks_per_seq_, live_sequences);
}

std::unique_ptr<DrafterSeq> Drafter::alloc_seq(int32_t budget_tokens) {
    require_finalized("dflash_drafter_seq_alloc");
    auto seq = std::make_unique<DrafterSeq>();
    seq->budget = sequence_budget(budget_tokens, p_.max_seq_len, "drafter");
    seq->table = BlockTable(backend_.get(), blocks_per_seq_);
    seq->slot_positions.assign(size_t(ring_slots_), -1);
    seq->slot_positions_dev = DeviceBuffer(backend_.get(), size_t(ring_slots_) * sizeof(int32_t));
    backend_->upload(seq->slot_positions_dev.get(), seq->slot_positions.data(),
                     seq->slot_positions_dev.bytes());
    seq->features = DeviceBuffer(backend_.get(), size_t(chunk_rows_) * size_t(feature_width_) * act_size_);
    if (backend_->graphs_enabled()) {  // zeros: only a graphed propose reads rows past the pending ones (padding)
        const std::vector<uint8_t> zeros(seq->features.bytes(), 0);
        backend_->upload(seq->features.get(), zeros.data(), zeros.size());
    }
    seq->staged = DeviceBuffer(backend_.get(), size_t(gamma_) * size_t(feature_width_) * act_size_);
    return seq;
}

void *Drafter::act(const DeviceBuffer &buffer, int64_t element_offset) const {
    return static_cast<char *>(buffer.get()) + element_offset * int64_t(act_size_);
}

// Makes the sequence hold the blocks that logical slots [0, logical_end) map to (all of the
// ring once it wraps). All-or-nothing: on POOL_EXHAUSTED the sequence is unchanged.
void Drafter::ensure_blocks(DrafterSeq &seq, int64_t logical_end) {
    seq.table.grow(pool_, *backend_, int32_t(std::min<int64_t>(
                                         blocks_per_seq_, ceil_div(logical_end, DFLASH_KV_BLOCK_SIZE))));
}

int32_t Drafter::physical_slot(const DrafterSeq &seq, int64_t logical) const {
    const int64_t ring = logical % ring_slots_;
    return seq.table.blocks()[size_t(ring / DFLASH_KV_BLOCK_SIZE)] * DFLASH_KV_BLOCK_SIZE +
           int32_t(ring % DFLASH_KV_BLOCK_SIZE);
}

// Gives logical slots [first, first+count) their positions (the host copy; upload_slot_positions
// sends them to the device) and writes their physical slot ids to slots_out.
void Drafter::stamp_slots(DrafterSeq &seq, int64_t first, const int32_t *positions,
                          int64_t count, int32_t *slots_out) {
    for (int64_t i = 0; i < count; ++i) {
        slots_out[i] = physical_slot(seq, first + i);
        seq.slot_positions[size_t((first + i) % ring_slots_)] = positions[i];
    }
}

// The pending context rows' arguments as project_pending reads them: their positions at out[0, P),
// their (newly stamped) physical slots at out[chunk_rows_, chunk_rows_ + P).
void Drafter::pending_args(DrafterSeq &seq, int32_t *out) {
    const int64_t P = int64_t(seq.pending_positions.size());
    std::copy(seq.pending_positions.begin(), seq.pending_positions.end(), out);
    stamp_slots(seq, seq.cached, seq.pending_positions.data(), P, out + chunk_rows_);
}

// Uploads the slot positions of logical slots [first, first+count): the touched ring range, in two
// pieces when it wraps.
void Drafter::upload_slot_positions(DrafterSeq &seq, int64_t first, int64_t count) {
    int64_t start = first % ring_slots_, left = std::min<int64_t>(count, ring_slots_);
    while (left > 0) {
        const int64_t n = std::min<int64_t>(left, ring_slots_ - start);
        backend_->upload(seq.slot_positions_dev.as<int32_t>() + start,
                         seq.slot_positions.data() + start, size_t(n) * sizeof(int32_t));
        left -= n;
        start = 0;
    }
}

// The incremental context precompute: projects the pending rows (those past the watermark)
// into every layer's K/V cache with one fc GEMM and one fused K/V GEMM.
void Drafter::project_pending(DrafterSeq &seq) {
    const int64_t P = int64_t(seq.pending_positions.size());
    if (P == 0) return;
    ensure_blocks(seq, seq.cached + P);
    std::vector<int32_t> args(size_t(chunk_rows_ + P));  // positions then slots, one upload
    pending_args(seq, args.data());
    upload_slot_positions(seq, seq.cached, P);
    backend_->upload(step_i32_.as<int32_t>() + 3 * gamma_, args.data(), args.size() * sizeof(int32_t));
    enqueue_projection(seq.features.get(), P);
    seq.cached += P;
    seq.pending_positions.clear();
}

void Drafter::enqueue_projection(const void *features, int64_t P) {
    const int64_t H = p_.hidden_size, hd = p_.head_dim, nkv = p_.num_kv_heads;
    int32_t *step = step_i32_.as<int32_t>();
    const int32_t *ctx_pos = step + 3 * gamma_, *ctx_slots = ctx_pos + chunk_rows_;
    // hidden_norm: a kernel, or (fold_input_) in fused_kv's weight, its GEMM norming with fc's sums of squares.
    float *ss = fold_input_ ? ss_.as<float>() : nullptr;
    backend_->gemm(features, P, feature_width_, weight("fc.weight"), ctx_h_.get(), H, GemmRows::Uniform,
                   GemmFuse{0.f, false, nullptr, ss});
    if (!fold_input_)
        backend_->rms_norm(ctx_h_.get(), P, 1, H, H, weight("hidden_norm.weight"), p_.rms_norm_eps, ctx_h_.get(), H);
    backend_->gemm(ctx_h_.get(), P, H, fused_kv_.view(), ctx_kv_.get(), fused_kv_width_, GemmRows::Uniform,
                   GemmFuse{fold_input_ ? p_.rms_norm_eps : 0.f, false, ss, nullptr});
    // Every layer's k norm + RoPE and cache writes in one call (one launch on cuda).
    std::vector<const WeightView *> k_norms;
    std::vector<void *> k_caches, v_caches;
    for (int l = 0; l < p_.num_layers; ++l) {
        k_norms.push_back(&layers_[l].k_norm);
        k_caches.push_back(k_cache_[l].get());
        v_caches.push_back(v_cache_[l].get());
    }
    backend_->kv_norm_rope_write_layers(ctx_kv_.get(), fused_kv_width_, 2 * kv_width_, p_.num_layers, P, nkv, hd,
                                        k_norms.data(), p_.rms_norm_eps, ctx_pos, inv_freq_.as<float>(),
                                        rope_.attention_factor, ctx_slots, k_caches.data(), v_caches.data());
}

void Drafter::append_context(DrafterSeq &seq, const void *data, dflash_dtype dtype,
                             bool on_device, int32_t n_rows, int32_t first_pos) {
    if (on_device && backend_->kind() == DFLASH_BACKEND_HOST)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "on_device features need the cuda backend; the host "
             "backend takes host pointers (on_device = 0)");
    append_rows(seq, data, dtype, on_device, n_rows, first_pos);
}

void Drafter::reserve_context(DrafterSeq &seq, int64_t n_rows) {
    const int64_t kept = p_.ctx_window > 0 ? std::min<int64_t>(n_rows, p_.ctx_window) : n_rows;
    ensure_blocks(seq, seq.cached + int64_t(seq.pending_positions.size()) + kept);
}

void Drafter::append_backend_rows(DrafterSeq &seq, const void *rows, int32_t n_rows) {
    append_rows(seq, rows, backend_->act_dtype(), true, n_rows, -1);
}

void Drafter::append_rows(DrafterSeq &seq, const void *data, dflash_dtype dtype, bool on_device,
                          int32_t n_rows, int32_t first_pos) {
    if (seq.awaiting_verify)
        fail(DFLASH_STATUS_INVALID_STATE, "append_context after a propose needs after_verify "
             "first (after_verify(0) discards the drafts)");
    if (n_rows < 0) fail(DFLASH_STATUS_INVALID_ARGUMENT, "n_rows ", n_rows, " is negative");
    if (!dtype_valid(dtype))
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "features dtype ", int(dtype), " is not a dflash_dtype");
    if (first_pos < -1)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "first_pos ", first_pos, " is negative (-1 = continue)");
    const int64_t first = first_pos == -1 ? seq.next_position : first_pos;
    if (first < seq.next_position)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "first_pos ", first, " is before the next position ",
             seq.next_position, " (context positions only move forward)");
    if (first + n_rows > seq.budget)
        fail(DFLASH_STATUS_CAPACITY, "context rows at positions ", first, "..",
             first + n_rows - 1, " exceed the sequence budget of ", seq.budget, " tokens");
    if (n_rows == 0) return;
    if (!data) fail(DFLASH_STATUS_INVALID_ARGUMENT, "features pointer is NULL");

    // Rows older than the newest ctx_window can never be attended to: skip them outright.
    const int64_t skip = p_.ctx_window > 0 ? std::max<int64_t>(0, n_rows - p_.ctx_window) : 0;
    const int64_t kept = n_rows - skip;
    reserve_context(seq, n_rows);

    const size_t row_bytes = size_t(feature_width_) * dtype_size(dtype);
    const char *src = static_cast<const char *>(data) + size_t(skip) * row_bytes;
    int64_t done = 0;
    while (done < kept) {
        if (int64_t(seq.pending_positions.size()) == chunk_rows_) project_pending(seq);
        const int64_t pending = int64_t(seq.pending_positions.size());
        const int64_t take = std::min<int64_t>(chunk_rows_ - pending, kept - done);
        backend_->convert_rows(src + size_t(done) * row_bytes, dtype, on_device, take,
                               feature_width_, act(seq.features, pending * feature_width_));
        for (int64_t i = 0; i < take; ++i)
            seq.pending_positions.push_back(int32_t(first + skip + done + i));
        done += take;
    }
    seq.context_rows += n_rows;
    seq.next_position = int32_t(first + n_rows);
}

int32_t Drafter::propose(DrafterSeq &seq, int32_t last_token, int32_t position,
                         int32_t num_drafts, const dflash_sampling_params *sampling,
                         int32_t *out_tokens, int32_t out_capacity) {
    const bool sample = sampling && sampling->temperature > 0 &&
                        sampling->draft_mode == DFLASH_DRAFT_SAMPLE;
    if (seq.awaiting_verify)
        fail(DFLASH_STATUS_INVALID_STATE, "propose while the previous propose awaits "
             "after_verify (after_verify(0) discards its drafts)");
    if (last_token < 0 || last_token >= p_.vocab_size)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "token ", last_token, " is outside the vocabulary [0, ",
             p_.vocab_size, ")");
    if (position != seq.next_position)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "position ", position, " must be one past the last "
             "context row (", seq.next_position, ")");
    if (num_drafts < 0) fail(DFLASH_STATUS_INVALID_ARGUMENT, "num_drafts ", num_drafts, " is negative");
    const int32_t width = std::clamp(num_drafts + 1, 2, gamma_);
    if (int64_t(position) + width > seq.budget)
        fail(DFLASH_STATUS_CAPACITY, "a block of ", width, " rows at position ", position,
             " exceeds the sequence budget of ", seq.budget, " tokens");
    if (!out_tokens) fail(DFLASH_STATUS_INVALID_ARGUMENT, "out_tokens is NULL");
    if (out_capacity < width - 1)
        fail(DFLASH_STATUS_CAPACITY, "out_tokens holds ", out_capacity, " tokens, ", width - 1,
             " drafts needed");

    const int64_t pending = int64_t(seq.pending_positions.size());
    ensure_blocks(seq, seq.cached + pending + width);  // all-or-nothing, before any work

    const int64_t H = p_.hidden_size, hd = p_.head_dim, nh = p_.num_heads, nkv = p_.num_kv_heads;
    const float eps = p_.rms_norm_eps;
    // A greedy propose without a context window runs its block as a graph (graphs_): the key count then
    // comes from step_i32_ too. Sampled proposes (their Philox key and sampling parameters are host values
    // of the launches) and windowed ones (first_key) stay eager.
    const bool graphed = !sample && p_.ctx_window == 0;
    // The pending rows' projection runs inside the graph. So that one graph serves every pending count, a graphed
    // propose projects them padded to a multiple of 16 rows (at most chunk_rows_): the padding rows' slots are -1
    // (the cache write skips them) and a GEMM's rows do not depend on its row count (kernels' batch invariance),
    // so the pending rows' keys and values are what P rows give. The weights are read once either way.
    const int64_t projected = graphed && backend_->graphs_enabled() && pending > 0
                                  ? std::min<int64_t>(chunk_rows_, (pending + 15) / 16 * 16)
                                  : pending;
    const size_t num_keys_at = size_t(4 * gamma_ + 2 * chunk_rows_);
    // Step arguments in one upload, before any kernel (an upload between kernels would stall the
    // programmatic overlap of the two), step_i32_'s layout whole: tokens, query positions and noise slots
    // of the block, the pending context rows' positions and slots, the drafts' place (written by the
    // kernels), the key count (read by the graphed kernels); the slot positions of both (one contiguous
    // ring range) in a second.
    std::vector<int32_t> args(num_keys_at + 2, 0);
    int32_t *tokens = args.data(), *q_pos = tokens + gamma_, *slots = q_pos + gamma_;
    if (pending) pending_args(seq, args.data() + 3 * gamma_);
    for (int64_t i = pending; i < projected; ++i) args[size_t(3 * gamma_ + chunk_rows_ + i)] = -1;  // padding
    for (int32_t j = 0; j < width; ++j) {
        tokens[j] = j == 0 ? last_token : p_.mask_token_id;
        q_pos[j] = position + j;
    }
    stamp_slots(seq, seq.cached + pending, q_pos, width, slots);
    const int64_t cached_after = seq.cached + pending;
    PagedKeys keys;
    keys.block_table = seq.table.device();
    keys.slot_positions = seq.slot_positions_dev.as<int32_t>();
    keys.ring_slots = ring_slots_;
    keys.uniform_rows = gamma_;  // every block width splits the keys alike
    keys.first_key = p_.ctx_window > 0 ? std::max<int64_t>(0, cached_after - p_.ctx_window) : 0;
    keys.num_keys = cached_after - keys.first_key + width;
    int32_t *dev = step_i32_.as<int32_t>();
    args[num_keys_at] = int32_t(keys.num_keys);
    // The keys this propose's kernels write (the pending context rows', the block's); the earlier ones were
    // written before the uploads below, so attention may stage them before it waits for its predecessors.
    keys.fresh_keys = pending + width;
    args[num_keys_at + 1] = int32_t(keys.fresh_keys);
    if (graphed) keys.num_keys_device = dev + num_keys_at, keys.fresh_keys_device = dev + num_keys_at + 1;
    upload_slot_positions(seq, seq.cached, pending + width);
    backend_->upload(dev, args.data(), args.size() * sizeof(int32_t));
    const void *features = seq.features.get();
    const int32_t *d_tokens = dev, *d_q_pos = dev + gamma_, *d_slots = dev + 2 * gamma_;
    int32_t *d_drafts = dev + 3 * gamma_ + 2 * chunk_rows_;

    auto block = [&] {
        if (projected) enqueue_projection(features, projected);  // the pending context rows into the caches
        const int64_t kv2 = 2 * kv_width_;
        // Each layer's input norm is fused with the residual add that ends the layer before it, or (fold_input_)
        // taken by the q/k/v GEMM itself from x_, with the sums of squares of the down before it (layer 0's from
        // embed).
        float *ss_qkv = fold_input_ ? ss_.as<float>() : nullptr;
        backend_->embed(d_tokens, width, embed(), p_.input_embedding_scale, x_.get(), ss_qkv);
        if (!fold_input_) backend_->rms_norm(x_.get(), width, 1, H, H, layers_[0].input_norm, eps, xn_.get(), H);
        for (int l = 0; l < p_.num_layers; ++l) {
            const Layer &layer = layers_[l];
            const bool last = l + 1 == p_.num_layers;
            // The block's own K/V go through the same k_proj/v_proj rows as the context: with q in one GEMM
            // (a row of q_: q heads, then k heads, then v heads), or fused_kv_'s slice.
            const bool one_gemm = !fused_qkv_.empty();
            const int64_t ldq = one_gemm ? q_width_ + kv2 : q_width_, ldkv = one_gemm ? ldq : kv2;
            void *kv = one_gemm ? act(q_, q_width_) : kv_.get();
            keys.k_cache = k_cache_[l].get();
            keys.v_cache = v_cache_[l].get();
            const Backend::RopeArgs rope{q_.get(), ldq, kv, ldkv, &layer.q_norm, &layer.k_norm, eps, d_q_pos,
                                         inv_freq_.as<float>(), rope_.attention_factor, d_slots};
            if (one_gemm) {  // fold_input_ implies one_gemm (finalize); ss_qkv is null without it
                backend_->gemm_qkv_rope(fold_input_ ? x_.get() : xn_.get(), width, H, layer.qkv_proj,
                                        GemmRows::Uniform, GemmFuse{fold_input_ ? eps : 0.f, false, ss_qkv, nullptr},
                                        rope, nh, nkv, hd, k_cache_[l].get(), v_cache_[l].get());
            } else {
                backend_->gemm(xn_.get(), width, H, layer.q_proj, q_.get(), q_width_);
                backend_->gemm(xn_.get(), width, H, fused_kv_.view().slice_rows(l * kv2, kv2), kv, kv2);
                backend_->qkv_norm_rope_write(q_.get(), ldq, kv, ldkv, width, nh, nkv, hd, &layer.q_norm,
                                              &layer.k_norm, eps, d_q_pos, inv_freq_.as<float>(),
                                              rope_.attention_factor, d_slots, k_cache_[l].get(), v_cache_[l].get());
            }
            backend_->attention(q_.get(), ldq, width, d_q_pos, nh, nkv, hd, 1.f / std::sqrt(float(hd)),
                                AttentionMask{layer.causal, layer.window}, keys, attn_.get());
            const WeightView next_norm = last ? weight("norm.weight") : layers_[l + 1].input_norm;
            if (folded_) {  // o_proj and down add into x_; gate/up norms x_ itself
                // o_proj's sums of squares only where gate/up reads them (Backend::reads_norm_stats).
                float *ss = backend_->reads_norm_stats(Backend::NormOp::SwiGLU) ? ss_.as<float>() : nullptr;
                backend_->gemm(attn_.get(), width, q_width_, layer.o_proj, x_.get(), H, GemmRows::Uniform,
                               GemmFuse{0.f, true, nullptr, ss});
                backend_->gemm_swiglu(x_.get(), width, H, layer.gate_up, p_.intermediate_size, gate_up_.get(),
                                      mlp_.get(), GemmRows::Uniform, GemmFuse{eps, false, ss, nullptr});
                backend_->gemm(mlp_.get(), width, p_.intermediate_size, layer.down, x_.get(), H, GemmRows::Uniform,
                               GemmFuse{0.f, true, nullptr, last ? nullptr : ss_qkv});
                if (!fold_input_ || last)  // the final norm feeds lm_head (and read_hidden)
                    backend_->rms_norm(x_.get(), width, 1, H, H, next_norm, eps, xn_.get(), H);
            } else {
                backend_->gemm(attn_.get(), width, q_width_, layer.o_proj, xn_.get(), H);
                backend_->add_rms_norm(x_.get(), xn_.get(), width, H, layer.post_norm, eps, xn_.get());
                backend_->gemm_swiglu(xn_.get(), width, H, layer.gate_up, p_.intermediate_size, gate_up_.get(),
                                      mlp_.get());
                backend_->gemm(mlp_.get(), width, p_.intermediate_size, layer.down, xn_.get(), H);
                backend_->add_rms_norm(x_.get(), xn_.get(), width, H, next_norm, eps, xn_.get());
            }
        }
        if (sample) {  // independent draws from q, which verify then uses as the proposal
            float *q = probs_.as<float>();
            backend_->logits(act(xn_, H), width - 1, lm_head(), p_.output_multiplier,
                             p_.final_logit_softcapping, q);
            backend_->sampling_probs(q, width - 1, p_.vocab_size, sampling->temperature,
                                     sampling->top_p, sampling->top_k);
            backend_->sample_rows(q, width - 1, p_.vocab_size, RngKey{sampling->seed, seq.rng_counter},
                                  0, RNG_DRAFT, d_drafts);
        } else {
            backend_->logits_argmax(act(xn_, H), width - 1, lm_head(), p_.output_multiplier,
                                    p_.final_logit_softcapping, d_drafts);
        }
    };
    if (graphed) {
        if (graphs_.run(*backend_,
                        ProposeKey{width, int32_t(projected), features, keys.block_table, keys.slot_positions},
                        block))
            ++seq.graph_replays;
    } else {
        block();
    }
    seq.cached += pending;  // projected by the block
    seq.pending_positions.clear();
    backend_->download(out_tokens, d_drafts, size_t(width - 1) * sizeof(int32_t));

    seq.rng_counter += 1;
    seq.awaiting_verify = true;
    seq.last_sampled = sample;
    seq.last_drafts.assign(out_tokens, out_tokens + width - 1);
    seq.staged_rows = 0;
    seq.last_num_drafts = width - 1;
    seq.proposals += 1;
    hidden_owner_ = &seq;
    hidden_rows_ = width - 1;
    return width - 1;
}

int32_t Drafter::read_hidden(const DrafterSeq &seq, float *out, int64_t out_capacity) {
    if (hidden_owner_ != &seq)
        fail(DFLASH_STATUS_INVALID_STATE, "no hidden states for this sequence: it has not "
             "proposed, or another sequence proposed (or it was reset) since");
    const int64_t H = p_.hidden_size, n = int64_t(hidden_rows_) * H;
    if (!out) fail(DFLASH_STATUS_INVALID_ARGUMENT, "out is NULL");
    if (out_capacity < n)
        fail(DFLASH_STATUS_CAPACITY, "out holds ", out_capacity, " floats, ", n, " needed (",
             hidden_rows_, " x ", H, ")");
    std::vector<uint8_t> raw(size_t(n) * act_size_);
    backend_->download(raw.data(), act(xn_, H), raw.size());
    for (int64_t i = 0; i < n; ++i) out[i] = load_as_float(raw.data(), backend_->act_dtype(), i);
    return hidden_rows_;
}

void Drafter::after_verify(DrafterSeq &seq, int32_t num_accepted) {
    if (!seq.awaiting_verify)
        fail(DFLASH_STATUS_INVALID_STATE, "after_verify without a propose awaiting verification");
    if (num_accepted < 0 || num_accepted > seq.last_num_drafts)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "num_accepted ", num_accepted, " is outside [0, ",
             seq.last_num_drafts, "] (drafts of the last propose)");
    // The block's noise K/V sit past the watermark and are simply overwritten by the next
    // context rows: dropping them costs nothing.
    if (seq.staged_rows && num_accepted + 1 > seq.staged_rows)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "num_accepted ", num_accepted, " needs ", num_accepted + 1,
             " context rows but the target verified only ", seq.staged_rows);
    seq.awaiting_verify = false;
    if (seq.staged_rows) {
        try {
            append_backend_rows(seq, seq.staged.get(), num_accepted + 1);
        } catch (...) {  // nothing changed: the caller may retry
            seq.awaiting_verify = true;
            throw;
        }
        seq.staged_rows = 0;
    }
    seq.accepted_drafts += num_accepted;
}

void Drafter::check_staging(const DrafterSeq &seq, const int32_t *tokens, int32_t n,
                            int32_t target_length) const {
    if (!seq.awaiting_verify)
        fail(DFLASH_STATUS_INVALID_STATE, "the drafter sequence given to verify has no propose "
             "awaiting verification");
    if (n - 1 > seq.last_num_drafts)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "verify of ", n - 1, " drafts, but the drafter proposed ",
             seq.last_num_drafts);
    for (int32_t j = 1; j < n; ++j)
        if (tokens[j] != seq.last_drafts[size_t(j - 1)])
            fail(DFLASH_STATUS_INVALID_ARGUMENT, "tokens[", j, "] = ", tokens[j],
                 " is not the drafter's draft ", seq.last_drafts[size_t(j - 1)]);
    if (target_length != seq.next_position)
        fail(DFLASH_STATUS_INVALID_STATE, "the target sequence holds ", target_length,
             " tokens but the drafter sequence proposed at position ", seq.next_position);
    if (seq.last_sampled && hidden_owner_ != &seq)
        fail(DFLASH_STATUS_INVALID_STATE, "the drafter's proposal distribution was overwritten "
             "by another sequence's propose; verify each sequence right after its propose");
}

const float *Drafter::stage(DrafterSeq &seq, const void *rows, int32_t n) {
    backend_->copy(seq.staged.get(), rows, size_t(n) * size_t(feature_width_) * act_size_);
    seq.staged_rows = n;
    return seq.last_sampled ? probs_.as<float>() : nullptr;
}

dflash_seq_info Drafter::info(const DrafterSeq &seq) const {
    dflash_seq_info s{};
    s.struct_size = sizeof(s);
    s.budget_tokens = seq.budget;
    s.next_position = seq.next_position;
    s.context_rows = seq.context_rows;
    s.cached_rows = int32_t(p_.ctx_window > 0 ? std::min<int64_t>(seq.cached, p_.ctx_window)
                                              : seq.cached);
    s.pending_rows = int32_t(seq.pending_positions.size());
    s.blocks_held = seq.table.size();
    s.proposals = seq.proposals;
    s.accepted_drafts = seq.accepted_drafts;
    s.graph_replays = seq.graph_replays;
    return s;
}

void Drafter::reset(DrafterSeq &seq) {
    seq.table.shrink(pool_, 0);
    std::fill(seq.slot_positions.begin(), seq.slot_positions.end(), -1);
    seq.pending_positions.clear();
    seq.cached = 0;
    seq.context_rows = 0;
    seq.next_position = 0;
    seq.awaiting_verify = false;
    seq.last_num_drafts = 0;
    seq.last_drafts.clear();
    seq.last_sampled = false;
    seq.staged_rows = 0;
    seq.rng_counter = 0;
    seq.proposals = 0;
    seq.accepted_drafts = 0;
    seq.graph_replays = 0;
    if (hidden_owner_ == &seq) hidden_owner_ = nullptr;
}

void Drafter::forget(const DrafterSeq *seq) {
    if (hidden_owner_ == seq) hidden_owner_ = nullptr;
    const int32_t *table = seq->table.device();
    graphs_.erase_if([table](const ProposeKey &k) { return k.table == table; });
}

}  // namespace dflash
