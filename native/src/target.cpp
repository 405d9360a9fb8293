// target.cpp: the target model's forward, prefill, verify and rollback. See target.hpp.
#include "target.hpp"

#include <algorithm>
#include <cmath>

namespace dflash {
namespace {

constexpr const char *kParams = "target params";

std::string layer_name(int i, const char *suffix) { return cat("layers.", i, ".", suffix); }

}  // namespace

Target::Target(std::shared_ptr<Backend> backend, const dflash_target_params &p)
    : backend_(std::move(backend)), p_(p), weights_(std::make_shared<WeightStore>(backend_)) {
    if (const char *missing = backend_->missing_ops())
        fail(DFLASH_STATUS_NOT_SUPPORTED, "the ",
             backend_->kind() == DFLASH_BACKEND_CUDA ? "cuda" : "host",
             " backend cannot run a target yet (missing: ", missing, "); use the host backend");
    check_range(kParams, "arch", p.arch, DFLASH_ARCH_QWEN3, DFLASH_ARCH_LLAMA);
    check_range(kParams, "num_layers", p.num_layers, 1, 1024);
    check_range(kParams, "hidden_size", p.hidden_size, 1, 1 << 20);
    check_range(kParams, "intermediate_size", p.intermediate_size, 1, 1 << 22);
    check_range(kParams, "num_heads", p.num_heads, 1, 1024);
    check_range(kParams, "num_kv_heads", p.num_kv_heads, 1, p.num_heads);
    if (p.num_heads % p.num_kv_heads)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "target params: num_heads ", p.num_heads,
             " is not a multiple of num_kv_heads ", p.num_kv_heads);
    check_range(kParams, "head_dim", p.head_dim, 2, 1024);
    if (p.head_dim % 2)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "target params: head_dim ", p.head_dim, " must be even");
    check_range(kParams, "vocab_size", p.vocab_size, 1, INT32_MAX);
    if (!(p.rms_norm_eps > 0))
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "target params: rms_norm_eps must be > 0");
    check_range(kParams, "max_position_embeddings", p.max_position_embeddings, 1, INT32_MAX);
    validate_rope(p.rope);
    check_range(kParams, "tie_word_embeddings", p.tie_word_embeddings, 0, 1);
    check_range(kParams, "max_batch", p.max_batch, 1, 1 << 16);
    check_range(kParams, "max_seq_len", p.max_seq_len, 1, 1 << 28);
    check_range(kParams, "max_verify_rows", p.max_verify_rows, 1, 1024);
    check_range(kParams, "prefill_chunk", p.prefill_chunk, 1, 1 << 16);

    const int64_t H = p.hidden_size, I = p.intermediate_size;
    q_width_ = int64_t(p.num_heads) * p.head_dim;
    kv_width_ = int64_t(p.num_kv_heads) * p.head_dim;
    max_rows_ = std::max(p.prefill_chunk, p.max_verify_rows);
    blocks_per_seq_ = int32_t(ceil_div(p.max_seq_len, DFLASH_KV_BLOCK_SIZE));
    act_size_ = dtype_size(backend_->act_dtype());
    rope_ = compute_rope(p.rope, p.head_dim, p.max_position_embeddings);

    WeightStore &w = *weights_;
    w.expect("embed_tokens.weight", {p.vocab_size, H});
    w.expect("norm.weight", {H});
    if (!p.tie_word_embeddings) w.expect("lm_head.weight", {p.vocab_size, H});
    for (int i = 0; i < p.num_layers; ++i) {
        w.expect(layer_name(i, "input_layernorm.weight"), {H});
        w.expect(layer_name(i, "post_attention_layernorm.weight"), {H});
        w.expect(layer_name(i, "self_attn.q_proj.weight"), {q_width_, H});
        w.expect(layer_name(i, "self_attn.k_proj.weight"), {kv_width_, H});
        w.expect(layer_name(i, "self_attn.v_proj.weight"), {kv_width_, H});
        w.expect(layer_name(i, "self_attn.o_proj.weight"), {H, q_width_});
        if (p.arch == DFLASH_ARCH_QWEN3) {
            w.expect(layer_name(i, "self_attn.q_norm.weight"), {p.head_dim});
            w.expect(layer_name(i, "self_attn.k_norm.weight"), {p.head_dim});
        }
        w.expect(layer_name(i, "mlp.gate_proj.weight"), {I, H});
        w.expect(layer_name(i, "mlp.up_proj.weight"), {I, H});
        w.expect(layer_name(i, "mlp.down_proj.weight"), {H, I});
    }
}

std::shared_ptr<const SharedHead> Target::shared_head() const {
    require_finalized("sharing the target's embed_tokens / lm_head");
    auto head = std::make_shared<SharedHead>();
    head->store = weights_;
    head->embed_name = "embed_tokens.weight";
    head->lm_head_name = p_.tie_word_embeddings ? "embed_tokens.weight" : "lm_head.weight";
    return head;
}

void Target::set_tensor(const std::string &name, dflash_dtype dtype, int32_t ndim,
                        const int64_t *shape, const void *data) {
    if (finalized_)
        fail(DFLASH_STATUS_INVALID_STATE, "tensor '", name, "' given after dflash_target_finalize");
    weights_->set(name, dtype, ndim, shape, data,
                  p_.arch == DFLASH_ARCH_LLAMA && name.find("_norm.weight") != std::string::npos &&
                          name.find("self_attn") != std::string::npos
                      ? " (Llama has no q_norm / k_norm)" : "");
}

void Target::finalize() {
    if (finalized_) fail(DFLASH_STATUS_INVALID_STATE, "target is already finalized");
    weights_->require_complete();
    // Built into locals and committed at the end: a failure leaves no partial allocation.
    const int L = p_.num_layers;
    std::vector<WeightStore::Tensor> fused;
    for (int i = 0; i < L; ++i) {
        fused.push_back(weights_->fuse_rows({layer_name(i, "self_attn.q_proj.weight"),
                                             layer_name(i, "self_attn.k_proj.weight"),
                                             layer_name(i, "self_attn.v_proj.weight")}));
        fused.push_back(weights_->fuse_rows({layer_name(i, "mlp.gate_proj.weight"),
                                             layer_name(i, "mlp.up_proj.weight")}));
    }
    // Where the backend folds norms (Backend::folds_norms), each layer's input norm goes into its
    // q/k/v weight and its post-attention norm into its gate/up weight (the fused copies: the store's
    // tensors stay as loaded, so a retried finalize folds once).
    const bool fold = backend_->folds_norms();
    for (int i = 0; fold && i < L; ++i) {
        backend_->fold_norm(fused[size_t(2 * i)].view(), weights_->view(layer_name(i, "input_layernorm.weight")));
        backend_->fold_norm(fused[size_t(2 * i + 1)].view(),
                            weights_->view(layer_name(i, "post_attention_layernorm.weight")));
    }
    // GEMM weights in the backend's streaming layout (a no-op on the host; the store's tensors are
    // tiled in place, idempotently, so a finalize that fails later can simply be retried).
    for (auto &t : fused) t = weights_->tiled_for_gemm(std::move(t));
    for (int i = 0; i < L; ++i)
        for (const char *n : {"self_attn.o_proj.weight", "mlp.down_proj.weight"})
            weights_->tile_for_gemm(layer_name(i, n));
    // A tied lm_head stays row-major: it is the embedding table, which the gather reads by rows (a
    // tiled copy would cost vocab x hidden more memory for a few percent of one GEMM).
    if (!p_.tie_word_embeddings) weights_->tile_for_gemm("lm_head.weight");
    const int32_t total_blocks = p_.max_batch * blocks_per_seq_ + 1;
    const size_t cache_bytes =
        size_t(total_blocks) * DFLASH_KV_BLOCK_SIZE * size_t(kv_width_) * act_size_;
    std::vector<DeviceBuffer> k_cache, v_cache;
    for (int i = 0; i < L; ++i) {
        k_cache.emplace_back(backend_.get(), cache_bytes);
        v_cache.emplace_back(backend_.get(), cache_bytes);
    }
    Backend *b = backend_.get();
    DeviceBuffer inv_freq(b, rope_.inv_freq.size() * sizeof(float));
    b->upload(inv_freq.get(), rope_.inv_freq.data(), inv_freq.bytes());
    const int32_t ring = blocks_per_seq_ * DFLASH_KV_BLOCK_SIZE;
    std::vector<int32_t> identity(static_cast<size_t>(ring));
    for (int32_t i = 0; i < ring; ++i) identity[size_t(i)] = i;
    DeviceBuffer key_positions(b, identity.size() * sizeof(int32_t));
    b->upload(key_positions.get(), identity.data(), key_positions.bytes());

    const size_t r = size_t(max_rows_), a = act_size_, H = size_t(p_.hidden_size);
    const size_t I = size_t(p_.intermediate_size), V = size_t(p_.vocab_size);
    DeviceBuffer x(b, r * H * a), xn(b, r * H * a), qkv(b, r * size_t(qkv_width()) * a),
        attn(b, r * size_t(q_width_) * a),
        gu(b, r * 2 * I * a), mlp(b, r * I * a),
        logits(b, size_t(p_.max_verify_rows) * V * sizeof(float)),
        step(b, (4 * r + 3 + size_t(blocks_per_seq_)) * sizeof(int32_t)),
        ss(fold ? b : nullptr, fold ? r * size_t(ss_parts(p_.hidden_size)) * sizeof(float) : 0);

    fused_ = std::move(fused);
    k_cache_ = std::move(k_cache);
    v_cache_ = std::move(v_cache);
    inv_freq_ = std::move(inv_freq);
    key_positions_ = std::move(key_positions);
    x_ = std::move(x); xn_ = std::move(xn); qkv_ = std::move(qkv);
    attn_ = std::move(attn); gate_up_ = std::move(gu); mlp_ = std::move(mlp);
    logits_ = std::move(logits); step_i32_ = std::move(step); ss_ = std::move(ss);
    folded_ = fold;
    layers_.clear();
    for (int i = 0; i < L; ++i) {
        for (const char *n : {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                              "mlp.gate_proj.weight", "mlp.up_proj.weight"})
            weights_->erase(layer_name(i, n));
        Layer layer;
        layer.input_norm = weights_->view(layer_name(i, "input_layernorm.weight"));
        layer.post_norm = weights_->view(layer_name(i, "post_attention_layernorm.weight"));
        layer.qkv_proj = fused_[size_t(2 * i)].view();
        if (p_.arch == DFLASH_ARCH_QWEN3) {
            layer.q_norm = weights_->view(layer_name(i, "self_attn.q_norm.weight"));
            layer.k_norm = weights_->view(layer_name(i, "self_attn.k_norm.weight"));
        }
        layer.o_proj = weights_->view(layer_name(i, "self_attn.o_proj.weight"));
        layer.gate_up = fused_[size_t(2 * i + 1)].view();
        layer.down = weights_->view(layer_name(i, "mlp.down_proj.weight"));
        layers_.push_back(layer);
    }
    pool_.reset(total_blocks);
    finalized_ = true;
}

void Target::require_finalized(const char *what) const {
    if (!finalized_)
        fail(DFLASH_STATUS_INVALID_STATE, what, " needs a finalized target (call "
             "dflash_target_finalize after setting every tensor)");
}

dflash_pool_stats Target::pool_stats(int32_t live_sequences) const {
    require_finalized("pool_stats");
    return pool_.stats(blocks_per_seq_, live_sequences);
}

std::unique_ptr<TargetSeq> Target::alloc_seq(int32_t budget_tokens) {
    require_finalized("dflash_target_seq_alloc");
    auto seq = std::make_unique<TargetSeq>();
    seq->budget = sequence_budget(budget_tokens, p_.max_seq_len, "target");
    return seq;
}

void *Target::act(const DeviceBuffer &buffer, int64_t element_offset) const {
    return static_cast<char *>(buffer.get()) + element_offset * int64_t(act_size_);
}

WeightView Target::lm_head() const {
    return weights_->view(p_.tie_word_embeddings ? "embed_tokens.weight" : "lm_head.weight");
}

void Target::check_tokens(const int32_t *tokens, int32_t n) const {
    if (n > 0 && !tokens) fail(DFLASH_STATUS_INVALID_ARGUMENT, "tokens is NULL");
    for (int32_t i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= p_.vocab_size)
            fail(DFLASH_STATUS_OUT_OF_RANGE, "tokens[", i, "] = ", tokens[i],
                 " is outside the vocabulary [0, ", p_.vocab_size, ")");
}

// All-or-nothing: the sequence holds the blocks for `length` tokens, or nothing changed.
void Target::ensure_blocks(TargetSeq &seq, int64_t length) {
    seq.table.grow(pool_, *backend_, int32_t(ceil_div(length, DFLASH_KV_BLOCK_SIZE)));
}

void Target::forward(TargetSeq &seq, const int32_t *tokens, int32_t n, const Drafter *capture) {
    const int64_t H = p_.hidden_size, hd = p_.head_dim, nh = p_.num_heads, nkv = p_.num_kv_heads;
    const float eps = p_.rms_norm_eps;
    const int32_t start = seq.length;
    // Everything that changes from step to step (or from sequence to sequence) goes to the device
    // in one upload, at offsets that depend on neither, so the kernels below (a graph once
    // recorded) read it from there: tokens, positions, slots, the key count, the block table.
    const size_t R = size_t(max_rows_);
    const std::vector<int32_t> &blocks = seq.table.blocks();
    std::vector<int32_t> args(3 * R + 1 + blocks.size());
    for (int32_t j = 0; j < n; ++j) {
        const int32_t pos = start + j;
        args[size_t(j)] = tokens[j];
        args[R + size_t(j)] = pos;
        args[2 * R + size_t(j)] = blocks[size_t(pos / DFLASH_KV_BLOCK_SIZE)] * DFLASH_KV_BLOCK_SIZE +
                                  pos % DFLASH_KV_BLOCK_SIZE;
    }
    args[3 * R] = start + n;
    std::copy(blocks.begin(), blocks.end(), args.begin() + long(3 * R + 1));
    int32_t *dev = step_i32_.as<int32_t>();
    backend_->upload(dev, args.data(), args.size() * sizeof(int32_t));
    const int32_t *d_tokens = dev, *d_pos = dev + R, *d_slots = dev + 2 * R;

    PagedKeys keys;
    keys.block_table = step_table();
    keys.slot_positions = key_positions_.as<int32_t>();
    keys.ring_slots = blocks_per_seq_ * DFLASH_KV_BLOCK_SIZE;
    keys.first_key = 0;
    keys.num_keys = int64_t(start) + n;
    keys.num_keys_device = dev + 3 * R;
    keys.uniform_rows = p_.max_verify_rows;  // verify and decode rows split the keys alike
    keys.fresh_keys = n;  // the keys before this forward's rows are settled: the upload above waited for them

    const int64_t F = capture ? capture->feature_width() : 0;
    const dflash_drafter_params *dp = capture ? &capture->params() : nullptr;
    auto capture_layer = [&](int layer, const void *rows) {
        for (int idx = 0; dp && idx < dp->num_target_layer_ids; ++idx)
            if (dp->target_layer_ids[idx] == layer)
                backend_->copy_rows(rows, H, n, H, act(capture_, idx * H), F);
    };

    // A prefill chunk's rows agree with no narrower call's: the backend may take its wide GEMM.
    const GemmRows gemm_rows = n > p_.max_verify_rows ? GemmRows::Wide : GemmRows::Uniform;
    auto ops = [&] {
        const int64_t ldq = qkv_width();  // a row of qkv_: q heads, then k heads, then v heads
        const bool qk_norm = p_.arch == DFLASH_ARCH_QWEN3;
        // Folded (folded_): the norms' weights are in the q/k/v and gate/up weights, those GEMMs norm x_ (GemmFuse's
        // norm_eps: the GEMM itself, or on cuda by default a unit-weight norm kernel before it) and o_proj / down
        // add into x_. Else each layer's input norm is fused with the residual add that ends the layer before it.
        // Where the norming op takes its rows' sums of squares from the producer (Backend::reads_norm_stats),
        // the residual-adding GEMM before it leaves them in ss_ (GemmFuse::ss_out / ss_in: o_proj's feed gate/up,
        // down's the next layer's q/k/v, embed's the first layer's); the last down's would have no reader (the
        // final norm kernel sums its rows itself). A prefill chunk (Wide) takes none: the wide GEMMs norm x
        // themselves and would never read them.
        float *ss = gemm_rows == GemmRows::Wide ? nullptr : ss_.as<float>();
        float *ss_qkv = folded_ && backend_->reads_norm_stats(Backend::NormOp::Gemm) ? ss : nullptr;
        float *ss_mlp = folded_ && backend_->reads_norm_stats(Backend::NormOp::SwiGLU) ? ss : nullptr;
        const GemmFuse to_mlp{0.f, true, nullptr, ss_mlp}, to_qkv{0.f, true, nullptr, ss_qkv};
        backend_->embed(d_tokens, n, weights_->view("embed_tokens.weight"), 1.f, x_.get(), ss_qkv);
        if (!folded_) backend_->rms_norm(x_.get(), n, 1, H, H, layers_[0].input_norm, eps, xn_.get(), H);
        for (int l = 0; l < p_.num_layers; ++l) {
            const Layer &layer = layers_[size_t(l)];
            keys.k_cache = k_cache_[size_t(l)].get();
            keys.v_cache = v_cache_[size_t(l)].get();
            const Backend::RopeArgs rope{qkv_.get(), ldq, act(qkv_, q_width_), ldq, qk_norm ? &layer.q_norm : nullptr,
                                         qk_norm ? &layer.k_norm : nullptr, eps, d_pos, inv_freq_.as<float>(),
                                         rope_.attention_factor, d_slots};
            backend_->gemm_qkv_rope(folded_ ? x_.get() : xn_.get(), n, H, layer.qkv_proj, gemm_rows,
                                    GemmFuse{folded_ ? eps : 0.f, false, ss_qkv, nullptr}, rope, nh, nkv, hd,
                                    k_cache_[size_t(l)].get(), v_cache_[size_t(l)].get());
            backend_->attention(qkv_.get(), ldq, n, d_pos, nh, nkv, hd, 1.f / std::sqrt(float(hd)),
                                AttentionMask{true, 0}, keys, attn_.get());
            const bool last = l + 1 == p_.num_layers;
            if (folded_) {
                backend_->gemm(attn_.get(), n, q_width_, layer.o_proj, x_.get(), H, gemm_rows, to_mlp);
                backend_->gemm_swiglu(x_.get(), n, H, layer.gate_up, p_.intermediate_size, gate_up_.get(),
                                      mlp_.get(), gemm_rows, GemmFuse{eps, false, ss_mlp, nullptr});
                backend_->gemm(mlp_.get(), n, p_.intermediate_size, layer.down, x_.get(), H, gemm_rows,
                               last ? GemmFuse{0.f, true} : to_qkv);
                if (last) backend_->rms_norm(x_.get(), n, 1, H, H, weights_->view("norm.weight"), eps, xn_.get(), H);
            } else {
                backend_->gemm(attn_.get(), n, q_width_, layer.o_proj, xn_.get(), H, gemm_rows);
                backend_->add_rms_norm(x_.get(), xn_.get(), n, H, layer.post_norm, eps, xn_.get());
                backend_->gemm_swiglu(xn_.get(), n, H, layer.gate_up, p_.intermediate_size, gate_up_.get(),
                                      mlp_.get(), gemm_rows);
                backend_->gemm(mlp_.get(), n, p_.intermediate_size, layer.down, xn_.get(), H, gemm_rows);
                backend_->add_rms_norm(x_.get(), xn_.get(), n, H,
                                       last ? weights_->view("norm.weight") : layers_[size_t(l) + 1].input_norm,
                                       eps, xn_.get());
            }
            // HF's hidden_states[l + 1] is this layer's output, except the last, which is normed.
            if (!last) capture_layer(l, x_.get());
        }
        capture_layer(p_.num_layers - 1, xn_.get());
    };
    if (n > p_.max_verify_rows) {  // a prefill chunk: one-off shapes, not worth a graph
        ops();
        return;
    }
    ForwardKey key;
    key.rows = n;
    if (dp) {
        key.capture = capture_.get();
        key.capture_width = F;
        key.capture_layers.assign(dp->target_layer_ids, dp->target_layer_ids + dp->num_target_layer_ids);
    }
    if (graphs_.run(*backend_, key, ops)) ++seq.graph_replays;
}

// Picks the next token from hidden row `row` of xn_ (greedy, or a sample with `key`).
int32_t Target::choose_last(const dflash_sampling_params &sampling, int32_t row, RngKey key) {
    int32_t *result = step_result();
    const void *h = act(xn_, int64_t(row) * p_.hidden_size);
    if (sampling.temperature > 0) {
        float *probs = logits_.as<float>();
        backend_->logits(h, 1, lm_head(), 1.f, 0.f, probs);
        backend_->sampling_probs(probs, 1, p_.vocab_size, sampling.temperature, sampling.top_p,
                                 sampling.top_k);
        backend_->sample_rows(probs, 1, p_.vocab_size, key, 0, RNG_SAMPLE, result);
    } else {
        backend_->logits_argmax(h, 1, lm_head(), 1.f, 0.f, result);
    }
    int32_t token = 0;
    backend_->download(&token, result, sizeof(int32_t));
    return token;
}

// Checks a drafter can read this target's hidden states, and sizes the capture buffer.
static void check_capture(const Drafter &drafter, const dflash_target_params &p) {
    const dflash_drafter_params &dp = drafter.params();
    if (dp.target_hidden_size != p.hidden_size)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "the drafter reads target hidden size ",
             dp.target_hidden_size, " but this target's is ", p.hidden_size);
    for (int i = 0; i < dp.num_target_layer_ids; ++i)
        if (dp.target_layer_ids[i] >= p.num_layers)
            fail(DFLASH_STATUS_INVALID_ARGUMENT, "the drafter's target_layer_ids[", i, "] = ",
                 dp.target_layer_ids[i], " is not a layer of this ", p.num_layers, "-layer target");
}

int32_t Target::prefill(TargetSeq &seq, const int32_t *tokens, int32_t n,
                        const dflash_sampling_params &sampling, Drafter *drafter,
                        DrafterSeq *capture) {
    require_finalized("prefill");
    if (n < 1) fail(DFLASH_STATUS_INVALID_ARGUMENT, "prefill needs at least one token, got ", n);
    check_tokens(tokens, n);
    if (int64_t(seq.length) + n > seq.budget)
        fail(DFLASH_STATUS_CAPACITY, "prefill of ", n, " tokens after ", seq.length,
             " exceeds the sequence budget of ", seq.budget, " tokens");
    if (capture) {
        check_capture(*drafter, p_);
        if (capture->next_position != seq.length)
            fail(DFLASH_STATUS_INVALID_STATE, "the drafter sequence's next position is ",
                 capture->next_position, " but the target sequence holds ", seq.length, " tokens");
        if (capture->awaiting_verify)
            fail(DFLASH_STATUS_INVALID_STATE, "the drafter sequence awaits after_verify");
        const int64_t width = drafter->feature_width();
        if (width > capture_width_) {  // first capture for a drafter this wide: size it once
            capture_ = DeviceBuffer(backend_.get(), size_t(max_rows_) * size_t(width) * act_size_);
            capture_width_ = width;
        }
    }
    // Every block either side will need is taken before any work, all-or-nothing, so a full
    // pool fails here with both sequences unchanged.
    const int32_t start = seq.length;
    const size_t blocks_before = size_t(seq.table.size());
    ensure_blocks(seq, int64_t(start) + n);
    try {
        if (capture) drafter->reserve_context(*capture, n);
        const RngKey key{sampling.seed, seq.rng_counter};
        int32_t next = -1;
        for (int32_t done = 0; done < n;) {
            const int32_t chunk = std::min(n - done, p_.prefill_chunk);
            forward(seq, tokens + done, chunk, capture ? drafter : nullptr);
            seq.length += chunk;
            if (capture) drafter->append_backend_rows(*capture, capture_.get(), chunk);
            done += chunk;
            if (done == n) next = choose_last(sampling, chunk - 1, key);
        }
        seq.rng_counter += 1;
        seq.steps += 1;
        return next;
    } catch (...) {
        seq.length = start;
        seq.table.shrink(pool_, std::max(blocks_before, size_t(ceil_div(start, DFLASH_KV_BLOCK_SIZE))));
        throw;
    }
}

std::pair<int32_t, int32_t> Target::verify(TargetSeq &seq, const int32_t *tokens, int32_t n,
                                           const dflash_sampling_params &sampling,
                                           Drafter *drafter, DrafterSeq *drafter_seq) {
    require_finalized("verify");
    if (n < 1 || n > p_.max_verify_rows)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "verify of ", n, " rows is outside [1, ",
             p_.max_verify_rows, "] (max_verify_rows)");
    check_tokens(tokens, n);
    if (int64_t(seq.length) + n > seq.budget)
        fail(DFLASH_STATUS_CAPACITY, "verify of ", n, " rows at position ", seq.length,
             " exceeds the sequence budget of ", seq.budget, " tokens");
    if (drafter_seq) {
        check_capture(*drafter, p_);
        drafter->check_staging(*drafter_seq, tokens, n, seq.length);
        const int64_t width = drafter->feature_width();
        if (width > capture_width_) {
            capture_ = DeviceBuffer(backend_.get(), size_t(max_rows_) * size_t(width) * act_size_);
            capture_width_ = width;
        }
    }
    ensure_blocks(seq, int64_t(seq.length) + n);
    forward(seq, tokens, n, drafter_seq ? drafter : nullptr);
    const float *q = drafter_seq ? drafter->stage(*drafter_seq, capture_.get(), n) : nullptr;

    const int32_t *d_tokens = step_i32_.as<int32_t>();  // forward uploaded the tokens first
    int32_t *posterior = step_posterior(), *result = step_result();
    if (sampling.temperature > 0) {
        float *p = logits_.as<float>();
        backend_->logits(xn_.get(), n, lm_head(), 1.f, 0.f, p);
        backend_->sampling_probs(p, n, p_.vocab_size, sampling.temperature, sampling.top_p,
                                 sampling.top_k);
        backend_->rejection_accept(p, d_tokens, q, n, p_.vocab_size,
                                   RngKey{sampling.seed, seq.rng_counter}, result);
    } else {
        backend_->logits_argmax(xn_.get(), n, lm_head(), 1.f, 0.f, posterior);
        backend_->greedy_accept(d_tokens, posterior, n, result);
    }
    int32_t out[2] = {0, 0};
    backend_->download(out, result, sizeof(out));
    seq.length += out[0] + 1;  // the anchor and the accepted drafts; the rest is rolled back
    seq.table.shrink(pool_, size_t(ceil_div(seq.length, DFLASH_KV_BLOCK_SIZE)));
    seq.rng_counter += 1;
    seq.steps += 1;
    return {out[0], out[1]};
}

void Target::rollback(TargetSeq &seq, int32_t n_rows) {
    if (n_rows < 0 || n_rows > seq.length)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "rollback of ", n_rows, " rows from a sequence of ",
             seq.length);
    seq.length -= n_rows;
    seq.table.shrink(pool_, size_t(ceil_div(seq.length, DFLASH_KV_BLOCK_SIZE)));
}

dflash_target_seq_stats Target::info(const TargetSeq &seq) const {
    dflash_target_seq_stats s{};
    s.struct_size = sizeof(s);
    s.budget_tokens = seq.budget;
    s.length = seq.length;
    s.blocks_held = seq.table.size();
    s.steps = seq.steps;
    s.graph_replays = int32_t(seq.graph_replays);
    return s;
}

void Target::reset(TargetSeq &seq) {
    seq.table.shrink(pool_, 0);
    seq.length = 0;
    seq.rng_counter = 0;
    seq.steps = 0;
}

}  // namespace dflash
