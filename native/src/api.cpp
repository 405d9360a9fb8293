// api.cpp: the C ABI edge. The only place that catches exceptions.
//
// Every entry point runs its body through `guard`, which converts an Error (or anything else)
// into a status and the thread-local last-error message. Handles are checked against a registry
// of live objects keyed by address and kind, so a NULL, destroyed, or wrong-kind handle is a
// clean DFLASH_STATUS_INVALID_HANDLE instead of undefined behaviour.
#include <mutex>
#include <new>
#include <set>
#include <unordered_map>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend.hpp"
#include "drafter.hpp"
#include "target.hpp"

using namespace dflash;

struct dflash_context {
    std::shared_ptr<Backend> backend;
};

struct dflash_drafter {
    std::shared_ptr<Backend> backend;  // keeps the context's backend alive
    std::unique_ptr<Drafter> impl;
    std::set<dflash_drafter_seq *> seqs;
};

struct dflash_drafter_seq {
    dflash_drafter *owner = nullptr;
    std::unique_ptr<DrafterSeq> state;
};

struct dflash_target {
    std::unique_ptr<Target> impl;
    std::set<dflash_target_seq *> seqs;
};

struct dflash_target_seq {
    dflash_target *owner = nullptr;
    std::unique_ptr<TargetSeq> state;
};

namespace {

enum class Kind { Context, Drafter, Seq, Target, TargetSeq };

const char *kind_name(Kind k) {
    switch (k) {
        case Kind::Context: return "context";
        case Kind::Drafter: return "drafter";
        case Kind::Seq: return "drafter sequence";
        case Kind::Target: return "target";
        case Kind::TargetSeq: return "target sequence";
    }
    return "?";
}

std::mutex registry_mutex;
std::unordered_map<const void *, Kind> &registry() {
    static std::unordered_map<const void *, Kind> live;
    return live;
}

void register_handle(const void *p, Kind k) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry()[p] = k;
}

void unregister_handle(const void *p) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry().erase(p);
}

template <typename T>
T *checked(T *handle, Kind k) {
    if (!handle) fail(DFLASH_STATUS_INVALID_HANDLE, kind_name(k), " handle is NULL");
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(handle);
    if (it == registry().end())
        fail(DFLASH_STATUS_INVALID_HANDLE, kind_name(k), " handle ", static_cast<const void *>(handle),
             " is not live (already destroyed",
             k == Kind::Seq ? ", or its drafter was destroyed)"
             : k == Kind::TargetSeq ? ", or its target was destroyed)" : ")");
    if (it->second != k)
        fail(DFLASH_STATUS_INVALID_HANDLE, "handle ", static_cast<const void *>(handle), " is a ",
             kind_name(it->second), ", not a ", kind_name(k));
    return handle;
}

thread_local std::string last_error;

template <typename F>
dflash_status guard(F &&body) {
    try {
        body();
        return DFLASH_STATUS_OK;
    } catch (const Error &e) {
        last_error = e.what();
        return e.status();
    } catch (const std::bad_alloc &) {
        last_error = "host out of memory";
        return DFLASH_STATUS_OUT_OF_MEMORY;
    } catch (const std::exception &e) {
        last_error = cat("internal error: ", e.what());
        return DFLASH_STATUS_INTERNAL;
    } catch (...) {
        last_error = "internal error: unknown exception";
        return DFLASH_STATUS_INTERNAL;
    }
}

template <typename T>
void require(const T *ptr, const char *what) {
    if (!ptr) fail(DFLASH_STATUS_INVALID_ARGUMENT, what, " is NULL");
}

void require_struct(uint32_t got, size_t expected, const char *what) {
    if (got != expected)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, what, ".struct_size is ", got, ", expected ",
             expected, " (use ", what, " from the matching dflash_*_default_params)");
}

void destroy_seq(dflash_drafter_seq *seq) {
    seq->owner->impl->reset(*seq->state);
    seq->owner->impl->forget(seq->state.get());
    unregister_handle(seq);
    delete seq;
}

void destroy_target_seq(dflash_target_seq *seq) {
    seq->owner->impl->reset(*seq->state);
    unregister_handle(seq);
    delete seq;
}

// --- what the drafter and the target handles share: pool stats, destroy (with every sequence still
// open) and sequence alloc. Owner is dflash_drafter / dflash_target, Seq its sequence handle. ---

template <typename Owner>
void owner_pool_stats(Owner *owner, Kind kind, dflash_pool_stats *out) {
    checked(owner, kind);
    require(out, "out");
    require_struct(out->struct_size, sizeof(dflash_pool_stats), "dflash_pool_stats");
    *out = owner->impl->pool_stats(int32_t(owner->seqs.size()));
}

template <typename Owner, typename Seq>
void owner_destroy(Owner *owner, Kind kind, void (*destroy)(Seq *)) {
    if (!owner) return;
    checked(owner, kind);
    for (Seq *seq : owner->seqs) destroy(seq);
    owner->seqs.clear();
    unregister_handle(owner);
    delete owner;
}

template <typename Seq, typename Owner>
void owner_seq_alloc(Owner *owner, Kind kind, Kind seq_kind, int32_t budget_tokens, Seq **out) {
    require(out, "out");
    *out = nullptr;
    checked(owner, kind);
    auto seq = std::make_unique<Seq>();
    seq->owner = owner;
    seq->state = owner->impl->alloc_seq(budget_tokens);
    owner->seqs.insert(seq.get());
    register_handle(seq.get(), seq_kind);
    *out = seq.release();
}

// NULL means greedy; anything else is checked field by field.
dflash_sampling_params resolve_sampling(const dflash_sampling_params *s) {
    dflash_sampling_params out = dflash_sampling_default_params();
    if (!s) return out;
    require_struct(s->struct_size, sizeof(dflash_sampling_params), "dflash_sampling_params");
    if (!(s->temperature >= 0) || !std::isfinite(s->temperature))
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "sampling temperature ", s->temperature,
             " must be finite and >= 0");
    if (!(s->top_p > 0 && s->top_p <= 1))
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "sampling top_p ", s->top_p, " must be in (0, 1]");
    if (s->top_k < 0) fail(DFLASH_STATUS_INVALID_ARGUMENT, "sampling top_k ", s->top_k, " is negative");
    if (s->draft_mode != DFLASH_DRAFT_GREEDY && s->draft_mode != DFLASH_DRAFT_SAMPLE)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "sampling draft_mode ", s->draft_mode,
             " is not a dflash_draft_mode");
    return *s;
}

// The drafter of a sequence passed to a target call, checked to share the target's context.
Drafter *drafter_for(dflash_drafter_seq *seq, const dflash_target *target) {
    if (!seq) return nullptr;
    checked(seq, Kind::Seq);
    Drafter *d = seq->owner->impl.get();
    if (d->backend() != target->impl->backend().get())
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "the drafter sequence belongs to a drafter on another "
             "context than the target (create it with dflash_drafter_create_for_target)");
    return d;
}

}  // namespace

extern "C" {

DFLASH_API int32_t dflash_abi_version(void) { return DFLASH_ABI_VERSION; }

DFLASH_API const char *dflash_status_string(dflash_status status) {
    switch (status) {
        case DFLASH_STATUS_OK: return "DFLASH_STATUS_OK";
        case DFLASH_STATUS_INVALID_ARGUMENT: return "DFLASH_STATUS_INVALID_ARGUMENT";
        case DFLASH_STATUS_INVALID_HANDLE: return "DFLASH_STATUS_INVALID_HANDLE";
        case DFLASH_STATUS_INVALID_STATE: return "DFLASH_STATUS_INVALID_STATE";
        case DFLASH_STATUS_OUT_OF_RANGE: return "DFLASH_STATUS_OUT_OF_RANGE";
        case DFLASH_STATUS_CAPACITY: return "DFLASH_STATUS_CAPACITY";
        case DFLASH_STATUS_POOL_EXHAUSTED: return "DFLASH_STATUS_POOL_EXHAUSTED";
        case DFLASH_STATUS_BAD_TENSOR: return "DFLASH_STATUS_BAD_TENSOR";
        case DFLASH_STATUS_OUT_OF_MEMORY: return "DFLASH_STATUS_OUT_OF_MEMORY";
        case DFLASH_STATUS_NOT_SUPPORTED: return "DFLASH_STATUS_NOT_SUPPORTED";
        case DFLASH_STATUS_NO_DEVICE: return "DFLASH_STATUS_NO_DEVICE";
        case DFLASH_STATUS_CUDA_ERROR: return "DFLASH_STATUS_CUDA_ERROR";
        case DFLASH_STATUS_INTERNAL: return "DFLASH_STATUS_INTERNAL";
    }
    return "DFLASH_STATUS_UNKNOWN";
}

DFLASH_API const char *dflash_last_error(void) { return last_error.c_str(); }

DFLASH_API const char *dflash_build_info(void) {
    static const std::string info =
        cuda_compiled() ? cat("libdflash abi ", DFLASH_ABI_VERSION, "; backends: host cuda(",
                              cuda_arch_list(), ")")
                        : cat("libdflash abi ", DFLASH_ABI_VERSION, "; backends: host");
    return info.c_str();
}

DFLASH_API int32_t dflash_backend_compiled(dflash_backend backend) {
    if (backend == DFLASH_BACKEND_HOST) return 1;
    if (backend == DFLASH_BACKEND_CUDA) return cuda_compiled() ? 1 : 0;
    return 0;
}

DFLASH_API dflash_status dflash_cuda_device_count(int32_t *out_count) {
    return guard([&] {
        require(out_count, "out_count");
        *out_count = 0;
        *out_count = cuda_device_count();
    });
}

/* --- context --- */

DFLASH_API dflash_context_params dflash_context_default_params(void) {
    dflash_context_params p{};
    p.struct_size = sizeof(p);
    p.backend = DFLASH_BACKEND_HOST;
    p.device = 0;
    p.stream = 0;
    p.cuda_graphs = 1;
    return p;
}

DFLASH_API dflash_status dflash_context_create(const dflash_context_params *params,
                                               dflash_context **out) {
    return guard([&] {
        require(out, "out");
        *out = nullptr;
        require(params, "params");
        require_struct(params->struct_size, sizeof(dflash_context_params), "dflash_context_params");
        auto ctx = std::make_unique<dflash_context>();
        switch (params->backend) {
            case DFLASH_BACKEND_HOST: ctx->backend = make_host_backend(); break;
            case DFLASH_BACKEND_CUDA:
            {
                const char *lever = std::getenv("DFLASH_CUDA_GRAPHS");  // a kill switch, read once
                const bool graphs = params->cuda_graphs != 0 && !(lever && std::strcmp(lever, "0") == 0);
                ctx->backend = make_cuda_backend(params->device, params->stream, graphs);
            }
                break;
            default:
                fail(DFLASH_STATUS_INVALID_ARGUMENT, "backend ", int(params->backend),
                     " is not a dflash_backend");
        }
        register_handle(ctx.get(), Kind::Context);
        *out = ctx.release();
    });
}

DFLASH_API dflash_status dflash_context_synchronize(dflash_context *ctx) {
    return guard([&] { checked(ctx, Kind::Context)->backend->synchronize(); });
}

DFLASH_API dflash_status dflash_context_destroy(dflash_context *ctx) {
    return guard([&] {
        if (!ctx) return;
        checked(ctx, Kind::Context);
        unregister_handle(ctx);
        delete ctx;
    });
}

/* --- drafter --- */

DFLASH_API dflash_drafter_params dflash_drafter_default_params(void) {
    dflash_drafter_params p{};
    p.struct_size = sizeof(p);
    p.rms_norm_eps = 1e-6f;
    p.max_position_embeddings = 32768;
    p.rope.type = DFLASH_ROPE_DEFAULT;
    p.rope.theta = 10000.0;
    p.rope.truncate = 1;
    p.rope.low_freq_factor = 1.0;
    p.rope.high_freq_factor = 4.0;
    p.is_causal = -1;
    p.block_size = 16;
    p.input_embedding_scale = 1.f;
    p.output_multiplier = 1.f;
    p.max_batch = 1;
    p.max_seq_len = 4096;
    return p;
}

DFLASH_API dflash_status dflash_drafter_create(dflash_context *ctx,
                                               const dflash_drafter_params *params,
                                               dflash_drafter **out) {
    return guard([&] {
        require(out, "out");
        *out = nullptr;
        checked(ctx, Kind::Context);
        require(params, "params");
        require_struct(params->struct_size, sizeof(dflash_drafter_params), "dflash_drafter_params");
        auto d = std::make_unique<dflash_drafter>();
        d->backend = ctx->backend;
        d->impl = std::make_unique<Drafter>(ctx->backend, *params);
        register_handle(d.get(), Kind::Drafter);
        *out = d.release();
    });
}

DFLASH_API dflash_status dflash_drafter_create_for_target(dflash_target *target,
                                                          const dflash_drafter_params *params,
                                                          dflash_drafter **out) {
    return guard([&] {
        require(out, "out");
        *out = nullptr;
        checked(target, Kind::Target);
        require(params, "params");
        require_struct(params->struct_size, sizeof(dflash_drafter_params), "dflash_drafter_params");
        const dflash_target_params &tp = target->impl->params();
        dflash_drafter_params p = *params;
        if (p.target_hidden_size == 0) p.target_hidden_size = tp.hidden_size;
        if (p.num_target_layers == 0) p.num_target_layers = tp.num_layers;
        auto mismatch = [](const char *field, int64_t drafter, int64_t target) {
            if (drafter != target)
                fail(DFLASH_STATUS_INVALID_ARGUMENT, "drafter ", field, " ", drafter,
                     " does not match the target's ", target);
        };
        mismatch("hidden_size", p.hidden_size, tp.hidden_size);
        mismatch("vocab_size", p.vocab_size, tp.vocab_size);
        mismatch("target_hidden_size", p.target_hidden_size, tp.hidden_size);
        mismatch("num_target_layers", p.num_target_layers, tp.num_layers);
        auto d = std::make_unique<dflash_drafter>();
        d->backend = target->impl->backend();
        d->impl = std::make_unique<Drafter>(d->backend, p, target->impl->shared_head());
        register_handle(d.get(), Kind::Drafter);
        *out = d.release();
    });
}

DFLASH_API dflash_status dflash_drafter_set_tensor(dflash_drafter *drafter, const char *name,
                                                   dflash_dtype dtype, int32_t ndim,
                                                   const int64_t *shape, const void *data) {
    return guard([&] {
        checked(drafter, Kind::Drafter);
        require(name, "name");
        drafter->impl->set_tensor(name, dtype, ndim, shape, data);
    });
}

DFLASH_API dflash_status dflash_drafter_finalize(dflash_drafter *drafter) {
    return guard([&] { checked(drafter, Kind::Drafter)->impl->finalize(); });
}

DFLASH_API dflash_status dflash_drafter_pool_stats(dflash_drafter *drafter,
                                                   dflash_pool_stats *out) {
    return guard([&] { owner_pool_stats(drafter, Kind::Drafter, out); });
}

DFLASH_API dflash_status dflash_drafter_destroy(dflash_drafter *drafter) {
    return guard([&] { owner_destroy(drafter, Kind::Drafter, destroy_seq); });
}

/* --- sequences --- */

DFLASH_API dflash_status dflash_drafter_seq_alloc(dflash_drafter *drafter, int32_t budget_tokens,
                                                  dflash_drafter_seq **out) {
    return guard([&] { owner_seq_alloc(drafter, Kind::Drafter, Kind::Seq, budget_tokens, out); });
}

DFLASH_API dflash_status dflash_drafter_seq_append_context(dflash_drafter_seq *seq,
                                                           const void *data, dflash_dtype dtype,
                                                           int32_t on_device, int32_t n_rows,
                                                           int32_t first_pos) {
    return guard([&] {
        checked(seq, Kind::Seq);
        seq->owner->impl->append_context(*seq->state, data, dtype, on_device != 0, n_rows,
                                         first_pos);
    });
}

DFLASH_API dflash_status dflash_drafter_seq_propose(dflash_drafter_seq *seq, int32_t last_token,
                                                    int32_t position, int32_t num_drafts,
                                                    int32_t *out_tokens, int32_t out_capacity,
                                                    int32_t *out_num_drafts) {
    return guard([&] {
        checked(seq, Kind::Seq);
        require(out_num_drafts, "out_num_drafts");
        *out_num_drafts = 0;
        *out_num_drafts = seq->owner->impl->propose(*seq->state, last_token, position,
                                                    num_drafts, nullptr, out_tokens, out_capacity);
    });
}

DFLASH_API dflash_status dflash_drafter_seq_propose_sampled(dflash_drafter_seq *seq,
                                                            int32_t last_token, int32_t position,
                                                            int32_t num_drafts,
                                                            const dflash_sampling_params *sampling,
                                                            int32_t *out_tokens,
                                                            int32_t out_capacity,
                                                            int32_t *out_num_drafts) {
    return guard([&] {
        checked(seq, Kind::Seq);
        require(out_num_drafts, "out_num_drafts");
        *out_num_drafts = 0;
        const dflash_sampling_params sp = resolve_sampling(sampling);
        *out_num_drafts = seq->owner->impl->propose(*seq->state, last_token, position,
                                                    num_drafts, &sp, out_tokens, out_capacity);
    });
}

DFLASH_API dflash_status dflash_drafter_seq_read_hidden(dflash_drafter_seq *seq, float *out,
                                                        int64_t out_capacity,
                                                        int32_t *out_rows) {
    return guard([&] {
        checked(seq, Kind::Seq);
        require(out_rows, "out_rows");
        *out_rows = 0;
        *out_rows = seq->owner->impl->read_hidden(*seq->state, out, out_capacity);
    });
}

DFLASH_API dflash_status dflash_drafter_seq_after_verify(dflash_drafter_seq *seq,
                                                         int32_t num_accepted) {
    return guard([&] {
        checked(seq, Kind::Seq);
        seq->owner->impl->after_verify(*seq->state, num_accepted);
    });
}

DFLASH_API dflash_status dflash_drafter_seq_info(dflash_drafter_seq *seq, dflash_seq_info *out) {
    return guard([&] {
        checked(seq, Kind::Seq);
        require(out, "out");
        // A caller built before graph_replays passes the size up to it and gets the fields before it.
        constexpr size_t kBeforeReplays = offsetof(dflash_seq_info, graph_replays);
        const size_t size = out->struct_size == kBeforeReplays ? kBeforeReplays : sizeof(dflash_seq_info);
        require_struct(out->struct_size, size, "dflash_seq_info");
        const dflash_seq_info info = seq->owner->impl->info(*seq->state);
        std::memcpy(out, &info, size);
        out->struct_size = uint32_t(size);
    });
}

DFLASH_API dflash_status dflash_drafter_seq_reset(dflash_drafter_seq *seq) {
    return guard([&] {
        checked(seq, Kind::Seq);
        seq->owner->impl->reset(*seq->state);
    });
}

DFLASH_API dflash_status dflash_drafter_seq_free(dflash_drafter_seq *seq) {
    return guard([&] {
        if (!seq) return;
        checked(seq, Kind::Seq);
        seq->owner->seqs.erase(seq);
        destroy_seq(seq);
    });
}

/* --- sampling --- */

DFLASH_API dflash_sampling_params dflash_sampling_default_params(void) {
    dflash_sampling_params p{};
    p.struct_size = sizeof(p);
    p.temperature = 0.f;
    p.top_p = 1.f;
    p.top_k = 0;
    p.seed = 0;
    p.draft_mode = DFLASH_DRAFT_GREEDY;
    return p;
}

/* --- target --- */

DFLASH_API dflash_target_params dflash_target_default_params(void) {
    dflash_target_params p{};
    p.struct_size = sizeof(p);
    p.arch = DFLASH_ARCH_QWEN3;
    p.rms_norm_eps = 1e-6f;
    p.max_position_embeddings = 32768;
    p.rope.type = DFLASH_ROPE_DEFAULT;
    p.rope.theta = 10000.0;
    p.rope.truncate = 1;
    p.rope.low_freq_factor = 1.0;
    p.rope.high_freq_factor = 4.0;
    p.max_batch = 1;
    p.max_seq_len = 4096;
    p.max_verify_rows = 16;
    p.prefill_chunk = 512;
    return p;
}

DFLASH_API dflash_status dflash_target_create(dflash_context *ctx,
                                              const dflash_target_params *params,
                                              dflash_target **out) {
    return guard([&] {
        require(out, "out");
        *out = nullptr;
        checked(ctx, Kind::Context);
        require(params, "params");
        require_struct(params->struct_size, sizeof(dflash_target_params), "dflash_target_params");
        auto t = std::make_unique<dflash_target>();
        t->impl = std::make_unique<Target>(ctx->backend, *params);
        register_handle(t.get(), Kind::Target);
        *out = t.release();
    });
}

DFLASH_API dflash_status dflash_target_set_tensor(dflash_target *target, const char *name,
                                                  dflash_dtype dtype, int32_t ndim,
                                                  const int64_t *shape, const void *data) {
    return guard([&] {
        checked(target, Kind::Target);
        require(name, "name");
        target->impl->set_tensor(name, dtype, ndim, shape, data);
    });
}

DFLASH_API dflash_status dflash_target_finalize(dflash_target *target) {
    return guard([&] { checked(target, Kind::Target)->impl->finalize(); });
}

DFLASH_API dflash_status dflash_target_pool_stats(dflash_target *target, dflash_pool_stats *out) {
    return guard([&] { owner_pool_stats(target, Kind::Target, out); });
}

DFLASH_API dflash_status dflash_target_destroy(dflash_target *target) {
    return guard([&] { owner_destroy(target, Kind::Target, destroy_target_seq); });
}

DFLASH_API dflash_status dflash_target_seq_alloc(dflash_target *target, int32_t budget_tokens,
                                                 dflash_target_seq **out) {
    return guard([&] { owner_seq_alloc(target, Kind::Target, Kind::TargetSeq, budget_tokens, out); });
}

DFLASH_API dflash_status dflash_target_seq_prefill(dflash_target_seq *seq, const int32_t *tokens,
                                                   int32_t n_tokens,
                                                   const dflash_sampling_params *sampling,
                                                   dflash_drafter_seq *capture_into,
                                                   int32_t *out_next_token) {
    return guard([&] {
        checked(seq, Kind::TargetSeq);
        require(out_next_token, "out_next_token");
        const dflash_sampling_params sp = resolve_sampling(sampling);
        Drafter *drafter = drafter_for(capture_into, seq->owner);
        *out_next_token = seq->owner->impl->prefill(*seq->state, tokens, n_tokens, sp, drafter,
                                                    capture_into ? capture_into->state.get() : nullptr);
    });
}

DFLASH_API dflash_status dflash_target_seq_verify(dflash_target_seq *seq, const int32_t *tokens,
                                                  int32_t n_tokens,
                                                  const dflash_sampling_params *sampling,
                                                  dflash_drafter_seq *drafter_seq,
                                                  int32_t *out_num_accepted,
                                                  int32_t *out_next_token) {
    return guard([&] {
        checked(seq, Kind::TargetSeq);
        require(out_num_accepted, "out_num_accepted");
        require(out_next_token, "out_next_token");
        const dflash_sampling_params sp = resolve_sampling(sampling);
        Drafter *drafter = drafter_for(drafter_seq, seq->owner);
        const auto result = seq->owner->impl->verify(
            *seq->state, tokens, n_tokens, sp, drafter,
            drafter_seq ? drafter_seq->state.get() : nullptr);
        *out_num_accepted = result.first;
        *out_next_token = result.second;
    });
}

DFLASH_API dflash_status dflash_target_seq_rollback(dflash_target_seq *seq, int32_t n_rows) {
    return guard([&] {
        checked(seq, Kind::TargetSeq);
        seq->owner->impl->rollback(*seq->state, n_rows);
    });
}

DFLASH_API dflash_status dflash_target_seq_info(dflash_target_seq *seq,
                                                dflash_target_seq_stats *out) {
    return guard([&] {
        checked(seq, Kind::TargetSeq);
        require(out, "out");
        require_struct(out->struct_size, sizeof(dflash_target_seq_stats), "dflash_target_seq_stats");
        *out = seq->owner->impl->info(*seq->state);
    });
}

DFLASH_API dflash_status dflash_target_seq_reset(dflash_target_seq *seq) {
    return guard([&] {
        checked(seq, Kind::TargetSeq);
        seq->owner->impl->reset(*seq->state);
    });
}

DFLASH_API dflash_status dflash_target_seq_free(dflash_target_seq *seq) {
    return guard([&] {
        if (!seq) return;
        checked(seq, Kind::TargetSeq);
        seq->owner->seqs.erase(seq);
        destroy_target_seq(seq);
    });
}

}  // extern "C"
