// drafter.hpp: the DFlash drafter engine, written once above the backends.
//
// A Drafter holds the validated config, the weights (uploaded once), the paged KV pool and the
// per-step scratch. A DrafterSeq is one sequence's state: its block table (a ring when
// ctx_window > 0), the absolute position stamped on every cached slot, the accumulator of
// context rows not yet projected, and the protocol state (propose -> after_verify -> append).
//
// Propose pipeline (DESIGN §1): pending context rows -> fc -> hidden_norm -> ONE GEMM against
// the fused [L*2*kv, H] K/V weight -> per layer k_norm + RoPE + cache write (the incremental
// precompute, only rows past the watermark `cached`); then the noise block [anchor, mask...]
// through every layer, attending non-causally (or causal + window on sliding layers) over the
// live context keys plus the block's own keys; final norm; lm_head fused with argmax.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"
#include "graph_cache.hpp"
#include "kv_cache.hpp"
#include "rope.hpp"
#include "weights.hpp"

namespace dflash {

class Drafter;

struct DrafterSeq {
    int32_t budget = 0;                 // positions [0, budget)
    BlockTable table;                   // [blocks_per_seq], a ring once it wraps
    std::vector<int32_t> slot_positions;// [ring_slots] stamped position per ring slot
    DeviceBuffer slot_positions_dev;    // device copy
    DeviceBuffer features;              // [chunk_rows, feature_width] act: the accumulator
    std::vector<int32_t> pending_positions;  // positions of the rows in `features`
    int64_t cached = 0;                 // context rows whose K/V were written (the watermark)
    int64_t context_rows = 0;           // rows appended since reset, skipped ones included
    int32_t next_position = 0;
    bool awaiting_verify = false;
    int32_t last_num_drafts = 0;
    std::vector<int32_t> last_drafts;   // host copy of the last propose's drafts
    bool last_sampled = false;          // drafts drawn from q (DFLASH_DRAFT_SAMPLE), else argmax
    DeviceBuffer staged;                // [block_size, feature_width] act: verify's captured rows
    int32_t staged_rows = 0;
    uint64_t rng_counter = 0;           // proposes drawn so far (the Philox call counter)
    int32_t proposals = 0;
    int64_t accepted_drafts = 0;
    int64_t graph_replays = 0;          // proposes whose block ran as a replayed CUDA graph
};

// A greedy propose (the pending context rows' projection, then the block: embed -> layers -> lm_head argmax)
// as one CUDA graph per block width, projected row count (the pending rows padded to a multiple of 16: in
// steady state always 16) and sequence: the sequence's features, block table and slot positions are the only
// per-sequence pointers its kernels read; everything that changes between proposes (tokens, positions, slots,
// the key count) sits in step_i32_ at fixed offsets. (The projection ran eagerly before the graph until
// session 27: eight launches the GPU waited for.)
struct ProposeKey {
    int32_t width = 0, projected = 0;
    const void *features = nullptr;
    const int32_t *table = nullptr, *slot_positions = nullptr;
    bool operator<(const ProposeKey &o) const {
        return std::tie(width, projected, features, table, slot_positions) <
               std::tie(o.width, o.projected, o.features, o.table, o.slot_positions);
    }
};

// The target's weights a drafter reads (embed_tokens, lm_head) when created for a target.
struct SharedHead {
    std::shared_ptr<const WeightStore> store;  // keeps the target's tensors alive
    std::string embed_name, lm_head_name;
};

class Drafter {
public:
    // `shared`: non-null when the drafter borrows embed_tokens / lm_head from a target.
    Drafter(std::shared_ptr<Backend> backend, const dflash_drafter_params &params,
            std::shared_ptr<const SharedHead> shared = nullptr);
    ~Drafter();

    const dflash_drafter_params &params() const { return p_; }
    Backend *backend() const { return backend_.get(); }
    int64_t feature_width() const { return feature_width_; }

    void set_tensor(const std::string &name, dflash_dtype dtype, int32_t ndim,
                    const int64_t *shape, const void *data);
    void finalize();
    bool finalized() const { return finalized_; }
    dflash_pool_stats pool_stats(int32_t live_sequences) const;

    std::unique_ptr<DrafterSeq> alloc_seq(int32_t budget_tokens);
    void append_context(DrafterSeq &seq, const void *data, dflash_dtype dtype, bool on_device,
                        int32_t n_rows, int32_t first_pos);
    int32_t propose(DrafterSeq &seq, int32_t last_token, int32_t position, int32_t num_drafts,
                    const dflash_sampling_params *sampling, int32_t *out_tokens,
                    int32_t out_capacity);
    // For a target: contiguous context rows already in backend memory (act dtype).
    void append_backend_rows(DrafterSeq &seq, const void *rows, int32_t n_rows);
    // Takes, all-or-nothing, the KV blocks that appending n_rows context rows will need, so a
    // target can make sure its capture cannot fail half-way.
    void reserve_context(DrafterSeq &seq, int64_t n_rows);
    // For a target's verify: checks the sequence proposed exactly tokens[1..n-1], is awaiting
    // after_verify at position target_length; then stage() keeps the n rows' features for
    // after_verify and returns the proposal rows q (nullptr: one-hot, i.e. greedy drafts).
    void check_staging(const DrafterSeq &seq, const int32_t *tokens, int32_t n,
                       int32_t target_length) const;
    const float *stage(DrafterSeq &seq, const void *rows, int32_t n);
    int32_t read_hidden(const DrafterSeq &seq, float *out, int64_t out_capacity);
    void after_verify(DrafterSeq &seq, int32_t num_accepted);
    dflash_seq_info info(const DrafterSeq &seq) const;
    void reset(DrafterSeq &seq);
    void forget(const DrafterSeq *seq);  // the sequence is being destroyed

private:
    struct Layer {
        WeightView input_norm, post_norm, q_proj, q_norm, k_norm, o_proj, gate_up, down;
        WeightView qkv_proj;  // [q + 2 kv, H] where the block's q and K/V are one GEMM (fused_qkv_), else q_proj
        bool causal = false;
        int32_t window = 0;
    };

    void require_finalized(const char *what) const;
    void append_rows(DrafterSeq &seq, const void *data, dflash_dtype dtype, bool on_device,
                     int32_t n_rows, int32_t first_pos);
    WeightView weight(const std::string &name) const;
    WeightView embed() const;
    WeightView lm_head() const;
    void ensure_blocks(DrafterSeq &seq, int64_t logical_end);
    int32_t physical_slot(const DrafterSeq &seq, int64_t logical) const;
    void stamp_slots(DrafterSeq &seq, int64_t first_logical, const int32_t *positions,
                     int64_t count, int32_t *slots_out);
    void upload_slot_positions(DrafterSeq &seq, int64_t first_logical, int64_t count);
    void pending_args(DrafterSeq &seq, int32_t *out);
    // Uploads the pending rows' arguments, enqueues their projection and makes them cached.
    void project_pending(DrafterSeq &seq);
    // The projection's kernels alone (P rows of `features`; their positions and slots in step_i32_): what
    // project_pending and a propose's graph enqueue.
    void enqueue_projection(const void *features, int64_t P);
    void *act(const DeviceBuffer &buffer, int64_t element_offset) const;

    std::shared_ptr<Backend> backend_;
    dflash_drafter_params p_;
    // derived sizes
    int64_t q_width_ = 0, kv_width_ = 0, fused_kv_width_ = 0, feature_width_ = 0;
    int32_t gamma_ = 0, chunk_rows_ = 0, blocks_per_seq_ = 0, ring_slots_ = 0;
    size_t act_size_ = 4;
    RopeTable rope_;

    WeightStore weights_;
    std::shared_ptr<const SharedHead> shared_;
    bool finalized_ = false;
    bool folded_ = false;  // post-attention norms folded into the gate/up weights (Backend::folds_norms)
    bool fold_input_ = false;  // input norms in the q/k/v weights, hidden_norm in fused_kv's (see finalize)

    // built by finalize
    WeightStore::Tensor fused_kv_;                    // [L*2*kv, H]: K0, V0, K1, V1, ...
    std::vector<WeightStore::Tensor> fused_gate_up_;  // per layer [2I, H]
    // per layer [q + 2 kv, H]: q_proj, k_proj, v_proj rows (the block's q and K/V in one GEMM; its K/V
    // rows repeat fused_kv_'s); empty where DFLASH_DRAFTER_FUSED_QKV=0
    std::vector<WeightStore::Tensor> fused_qkv_;
    std::vector<Layer> layers_;
    BlockPool pool_;
    std::vector<DeviceBuffer> k_cache_, v_cache_;  // per layer [blocks, 16, kv_width]
    DeviceBuffer inv_freq_;
    // scratch (gamma rows for the block, chunk_rows rows for the context projection)
    DeviceBuffer x_, xn_, q_, kv_, attn_, gate_up_, mlp_, ctx_h_, ctx_kv_;
    DeviceBuffer ss_;  // folded_: rows' sums of squares, o_proj to gate/up, down to q/k/v, fc to fused_kv (GemmFuse)
    // tokens [gamma], q positions [gamma], noise slots [gamma], ctx positions [chunk_rows], ctx slots
    // [chunk_rows], drafts [gamma], the block's key count [1]
    DeviceBuffer step_i32_;
    GraphCache<ProposeKey> graphs_;  // greedy proposes' blocks (ctx_window 0)
    DeviceBuffer probs_;     // [block_size, vocab] fp32: sampled proposals' q (or logits)
    const DrafterSeq *hidden_owner_ = nullptr;  // whose hidden states xn_ (and q) hold
    int32_t hidden_rows_ = 0;
};

}  // namespace dflash
