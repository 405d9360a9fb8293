// target.hpp: the target model (Qwen3 dense, Llama) that verifies drafts.
//
// A Target holds its weights, a paged causal KV pool and per-step scratch; a TargetSeq is one
// sequence's block table and length. Prefill appends prompt rows in chunks; verify runs one
// forward over [anchor, drafts...], decides acceptance in the library (greedy argmax match or
// Leviathan rejection sampling) and keeps only the committed rows. While it runs, the outputs of
// the drafter's target_layer_ids are captured and handed to the drafter sequence without leaving
// backend memory.
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend.hpp"
#include "drafter.hpp"
#include "graph_cache.hpp"
#include "kv_cache.hpp"
#include "rope.hpp"
#include "weights.hpp"

namespace dflash {

// What a forward's recorded kernels depend on (the sequence's state travels in device memory):
// the row count and where (and from which layers) the drafter's features are captured.
struct ForwardKey {
    int32_t rows = 0;
    const void *capture = nullptr;        // the capture buffer, or nullptr
    int64_t capture_width = 0;
    std::vector<int32_t> capture_layers;  // the drafter's target_layer_ids
    bool operator<(const ForwardKey &o) const {
        return std::tie(rows, capture, capture_width, capture_layers) <
               std::tie(o.rows, o.capture, o.capture_width, o.capture_layers);
    }
};

struct TargetSeq {
    int32_t budget = 0;
    BlockTable table;              // host only: each forward uploads it with its arguments
    int32_t length = 0;            // tokens whose K/V are committed
    uint64_t rng_counter = 0;      // prefill/verify calls drawn so far
    int32_t steps = 0;
    int64_t graph_replays = 0;     // forwards of this sequence replayed from a graph
};

class Target {
public:
    Target(std::shared_ptr<Backend> backend, const dflash_target_params &params);

    const dflash_target_params &params() const { return p_; }
    const std::shared_ptr<Backend> &backend() const { return backend_; }
    // The store holding embed_tokens / lm_head, and their names, for a drafter to share.
    std::shared_ptr<const SharedHead> shared_head() const;

    void set_tensor(const std::string &name, dflash_dtype dtype, int32_t ndim, const int64_t *shape,
                    const void *data);
    void finalize();
    dflash_pool_stats pool_stats(int32_t live_sequences) const;

    std::unique_ptr<TargetSeq> alloc_seq(int32_t budget_tokens);
    int32_t prefill(TargetSeq &seq, const int32_t *tokens, int32_t n,
                    const dflash_sampling_params &sampling, Drafter *drafter, DrafterSeq *capture);
    // Returns {accepted, next token}.
    std::pair<int32_t, int32_t> verify(TargetSeq &seq, const int32_t *tokens, int32_t n,
                                       const dflash_sampling_params &sampling, Drafter *drafter,
                                       DrafterSeq *drafter_seq);
    void rollback(TargetSeq &seq, int32_t n_rows);
    dflash_target_seq_stats info(const TargetSeq &seq) const;
    void reset(TargetSeq &seq);

private:
    struct Layer {
        WeightView input_norm, post_norm, qkv_proj, q_norm, k_norm, o_proj, gate_up, down;
    };

    void require_finalized(const char *what) const;
    void check_tokens(const int32_t *tokens, int32_t n) const;
    void ensure_blocks(TargetSeq &seq, int64_t length);
    // One forward over rows at positions seq.length.. (K/V written, length unchanged). Leaves the
    // final normed hidden states in xn_; with `capture`, fills capture_ [n, n_ids*H].
    void forward(TargetSeq &seq, const int32_t *tokens, int32_t n, const Drafter *capture);
    void *act(const DeviceBuffer &buffer, int64_t element_offset) const;
    WeightView lm_head() const;
    int32_t choose_last(const dflash_sampling_params &sampling, int32_t row, RngKey key);

    std::shared_ptr<Backend> backend_;
    dflash_target_params p_;
    std::shared_ptr<WeightStore> weights_;
    bool finalized_ = false;
    bool folded_ = false;  // norms folded into the q/k/v and gate/up weights (Backend::folds_norms)
    int64_t q_width_ = 0, kv_width_ = 0;
    int64_t qkv_width() const { return q_width_ + 2 * kv_width_; }
    int32_t max_rows_ = 0, blocks_per_seq_ = 0;
    size_t act_size_ = 4;
    RopeTable rope_;

    std::vector<WeightStore::Tensor> fused_;  // per layer: [Q;K;V] then [gate;up]
    std::vector<Layer> layers_;
    BlockPool pool_;
    std::vector<DeviceBuffer> k_cache_, v_cache_;
    DeviceBuffer inv_freq_, key_positions_;  // key_positions_: 0, 1, 2, ... (slot r is position r)
    DeviceBuffer x_, xn_, qkv_, attn_, gate_up_, mlp_, logits_, capture_;
    int64_t capture_width_ = 0;
    // A forward's arguments at fixed offsets (so one recorded graph serves every sequence):
    // tokens [max_rows], positions [max_rows], slots [max_rows], key count [1], the sequence's
    // block table [blocks_per_seq]; then the posterior [max_rows] and the result [2].
    DeviceBuffer step_i32_;
    DeviceBuffer ss_;  // folded_: the rows' sums of squares between GEMMs (GemmFuse::ss_out / ss_in)
    int32_t *step_table() const { return step_i32_.as<int32_t>() + 3 * max_rows_ + 1; }
    int32_t *step_posterior() const { return step_table() + blocks_per_seq_; }
    int32_t *step_result() const { return step_posterior() + max_rows_; }
    GraphCache<ForwardKey> graphs_;  // verify / decode forwards, shared by every sequence
};

}  // namespace dflash
