/*
 * dflash.h: the public C ABI of libdflash, a DFlash speculative-decoding engine.
 *
 * Pure C99, one header, opaque handles. Usable from C, C++, Python (cffi), Rust, Go.
 *
 * Conventions
 * - Every fallible call returns a dflash_status (0 = DFLASH_STATUS_OK). On failure,
 *   dflash_last_error() returns a message for the calling thread that names what was wrong and
 *   with which values. A failed call leaves the object usable (or at least destroyable): no state
 *   is half-changed, no memory or KV block is leaked.
 * - Nothing throws, aborts or exits across this boundary.
 * - Params structs start with `struct_size` and come from dflash_*_default_params(); they are
 *   passed by pointer and only ever grow at the end, so an older caller keeps working. Their
 *   fields are fixed-width integers and floats (enum values are stored in int32_t fields), so
 *   every language sees the same layout.
 * - Handles are checked: a NULL, destroyed or foreign handle gives DFLASH_STATUS_INVALID_HANDLE,
 *   never undefined behaviour. Destroy functions accept NULL (no-op, OK); destroying twice is
 *   DFLASH_STATUS_INVALID_HANDLE.
 * - Threads: different handles may be used from different threads. One drafter and its
 *   sequences must be used by one thread at a time.
 * - Streams: every op enqueues on the context's stream (cuda backend) and the calls documented
 *   "returns after completion" wait for their own work with an event, not a device sync.
 *
 * Paged drafter KV cache (described once, for callers that inspect pool statistics)
 * - The pool holds `total_blocks` blocks of DFLASH_KV_BLOCK_SIZE token slots per layer, K and V
 *   separate, layout [num_blocks, DFLASH_KV_BLOCK_SIZE, num_kv_heads, head_dim].
 * - Each sequence owns a block table (indptr-free CSR row: the list of its physical blocks). Its
 *   context rows live at logical slots 0,1,2,... and logical slot r maps to block
 *   table[(r mod ring) / DFLASH_KV_BLOCK_SIZE], offset (r mod ring) % DFLASH_KV_BLOCK_SIZE, where
 *   ring = blocks_per_sequence * DFLASH_KV_BLOCK_SIZE. With ctx_window > 0 the table is a ring
 *   that keeps the newest ctx_window rows; with ctx_window = 0 it never wraps within the budget.
 * - Every slot carries the absolute position stamped when its row was inserted; masks (causal,
 *   sliding window) compare stamped positions, never slot indices.
 * - Pool size = max_batch * blocks_per_sequence + 1 spare, where blocks_per_sequence =
 *   ceil((min(max_seq_len, ctx_window or max_seq_len) + block_size) / DFLASH_KV_BLOCK_SIZE).
 *   Blocks are taken lazily as a sequence grows and all returned by reset/free.
 */
#ifndef DFLASH_H
#define DFLASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(DFLASH_BUILDING_LIBRARY)
#define DFLASH_API __attribute__((visibility("default")))
#else
#define DFLASH_API
#endif

#define DFLASH_ABI_VERSION 1
#define DFLASH_KV_BLOCK_SIZE 16
#define DFLASH_MAX_LAYERS 128
#define DFLASH_MAX_TARGET_LAYER_IDS 32

/* ------------------------------------------------------------------------------------------ */
/* Status, errors, versions                                                                   */
/* ------------------------------------------------------------------------------------------ */

typedef enum dflash_status {
    DFLASH_STATUS_OK = 0,
    DFLASH_STATUS_INVALID_ARGUMENT = 1, /* NULL pointer, wrong size, bad enum, bad params */
    DFLASH_STATUS_INVALID_HANDLE = 2,   /* NULL, destroyed or foreign handle; double free */
    DFLASH_STATUS_INVALID_STATE = 3,    /* call out of order (e.g. propose before finalize) */
    DFLASH_STATUS_OUT_OF_RANGE = 4,     /* token id >= vocab, position mismatch, count too large */
    DFLASH_STATUS_CAPACITY = 5,         /* sequence budget or caller buffer too small */
    DFLASH_STATUS_POOL_EXHAUSTED = 6,   /* no free KV block; free a sequence and retry */
    DFLASH_STATUS_BAD_TENSOR = 7,       /* unknown, missing, duplicate or misshaped tensor */
    DFLASH_STATUS_OUT_OF_MEMORY = 8,    /* host or device allocation failed; nothing leaked */
    DFLASH_STATUS_NOT_SUPPORTED = 9,    /* backend or feature not built or not implemented yet */
    DFLASH_STATUS_NO_DEVICE = 10,       /* no usable CUDA device / driver */
    DFLASH_STATUS_CUDA_ERROR = 11,      /* a CUDA call failed; message has the error name */
    DFLASH_STATUS_INTERNAL = 12         /* a bug in libdflash; please report the message */
} dflash_status;

/* The value of DFLASH_ABI_VERSION this library was built with. Bindings refuse a mismatch. */
DFLASH_API int32_t dflash_abi_version(void);

/* Static name of a status ("DFLASH_STATUS_OK", ...). Never NULL. */
DFLASH_API const char *dflash_status_string(dflash_status status);

/* Message of the last failed call on this thread ("" if none). Owned by the library. Successful
 * calls, dflash_status_string and dflash_last_error itself leave it alone; it stays valid until the
 * next failing dflash_* call on this thread. */
DFLASH_API const char *dflash_last_error(void);

/* Static build description, e.g. "libdflash abi 1; backends: host cuda(sm_80,sm_90)". */
DFLASH_API const char *dflash_build_info(void);

/* ------------------------------------------------------------------------------------------ */
/* Enums shared by several objects                                                            */
/* ------------------------------------------------------------------------------------------ */

typedef enum dflash_backend {
    DFLASH_BACKEND_HOST = 0, /* plain C++ reference, fp32 activations; always built */
    DFLASH_BACKEND_CUDA = 1  /* NVIDIA GPUs; built when nvcc was found (DFLASH_CUDA=ON) */
} dflash_backend;

typedef enum dflash_dtype {
    DFLASH_DTYPE_F32 = 0,
    DFLASH_DTYPE_F16 = 1,
    DFLASH_DTYPE_BF16 = 2
} dflash_dtype;

typedef enum dflash_rope_type {
    DFLASH_ROPE_DEFAULT = 0, /* inv_freq = theta^(-2i/d) */
    DFLASH_ROPE_YARN = 1,    /* transformers' _compute_yarn_parameters, incl. the attention factor */
    DFLASH_ROPE_LLAMA3 = 2   /* transformers' _compute_llama3_parameters */
} dflash_rope_type;

typedef enum dflash_layer_type {
    DFLASH_LAYER_FULL_ATTENTION = 0,
    DFLASH_LAYER_SLIDING_ATTENTION = 1
} dflash_layer_type;

/* 1 if `backend` was compiled into this library, else 0. Says nothing about devices. */
DFLASH_API int32_t dflash_backend_compiled(dflash_backend backend);

/* Number of CUDA devices visible. Returns DFLASH_STATUS_NOT_SUPPORTED in a host-only build and
 * DFLASH_STATUS_NO_DEVICE (with *out_count = 0) when there is no driver or device. */
DFLASH_API dflash_status dflash_cuda_device_count(int32_t *out_count);

/* KV pool statistics of a drafter or a target (see the paged KV description above). */
typedef struct dflash_pool_stats {
    uint32_t struct_size;     /* sizeof(dflash_pool_stats), set by the caller */
    int32_t total_blocks;     /* KV blocks in the pool */
    int32_t free_blocks;      /* KV blocks not held by any sequence */
    int32_t block_size;       /* token slots per block (DFLASH_KV_BLOCK_SIZE) */
    int32_t blocks_per_sequence; /* most blocks one sequence can hold */
    int32_t live_sequences;   /* sequences allocated and not freed */
} dflash_pool_stats;

/* ------------------------------------------------------------------------------------------ */
/* Context: a backend, a device and a stream                                                  */
/* ------------------------------------------------------------------------------------------ */

typedef struct dflash_context dflash_context;

typedef struct dflash_context_params {
    uint32_t struct_size;   /* sizeof(dflash_context_params) */
    int32_t backend;        /* a dflash_backend; default DFLASH_BACKEND_HOST */
    int32_t device;         /* CUDA device ordinal; ignored by host. default 0 */
    uint64_t stream;        /* cudaStream_t as an integer; 0 = the library creates its own
                               stream (destroyed with the context). A given stream is borrowed
                               and must outlive the context. Ignored by host. */
    int32_t cuda_graphs;    /* 1 (default): a target's verify / decode forward is recorded once per
                               row count (and drafter capture layout) as a CUDA graph, shared by its
                               sequences, and replayed (identical results, fewer launches); 0: always
                               launched kernel by kernel. The
                               environment variable DFLASH_CUDA_GRAPHS=0 forces 0 at create.
                               Ignored by host. While a graph is recorded, no other thread may
                               enqueue on a given stream. */
} dflash_context_params;

DFLASH_API dflash_context_params dflash_context_default_params(void);

/* Creates a context. On success *out owns it; free with dflash_context_destroy. A drafter keeps
 * its context's backend alive, so the context may be destroyed before its drafters. */
DFLASH_API dflash_status dflash_context_create(const dflash_context_params *params,
                                               dflash_context **out);

/* Waits until all work enqueued on the context's stream has finished. */
DFLASH_API dflash_status dflash_context_synchronize(dflash_context *ctx);

/* Destroys the handle. NULL is OK; a second destroy is DFLASH_STATUS_INVALID_HANDLE. */
DFLASH_API dflash_status dflash_context_destroy(dflash_context *ctx);

/* ------------------------------------------------------------------------------------------ */
/* RoPE description (the drafter's own config; a target uses the same struct later)           */
/* ------------------------------------------------------------------------------------------ */

typedef struct dflash_rope_params {
    int32_t type;                        /* a dflash_rope_type; default DFLASH_ROPE_DEFAULT */
    double theta;                        /* base; default 10000 */
    double factor;                       /* yarn/llama3 scaling factor; 0 = from max_position /
                                            original_max_position (yarn) */
    int32_t original_max_position;       /* yarn/llama3; 0 = max_position_embeddings */
    double beta_fast;                    /* yarn; 0 = 32 */
    double beta_slow;                    /* yarn; 0 = 1 */
    double attention_factor;             /* yarn cos/sin scale; 0 = computed as transformers does */
    double mscale;                       /* yarn; 0 = unset */
    double mscale_all_dim;               /* yarn; 0 = unset */
    int32_t truncate;                    /* yarn correction-range truncation; default 1 */
    double low_freq_factor;              /* llama3; default 1 */
    double high_freq_factor;             /* llama3; default 4 */
} dflash_rope_params;

/* ------------------------------------------------------------------------------------------ */
/* Sampling                                                                                   */
/* ------------------------------------------------------------------------------------------ */

typedef enum dflash_draft_mode {
    DFLASH_DRAFT_GREEDY = 0, /* drafts are the drafter's argmax; proposal q is one-hot (default:
                                coherent blocks, and still exact: rejection sampling with q = 1) */
    DFLASH_DRAFT_SAMPLE = 1  /* each draft sampled independently from the drafter's own
                                temperature/top-p/top-k distribution q, as dflash.model does */
} dflash_draft_mode;

/* How tokens are chosen. temperature 0 = greedy (argmax) everywhere; then the other fields are
 * ignored. Random numbers come from a counter-based generator (Philox4x32-10) keyed by `seed`
 * and by a per-sequence call counter, so a run is reproducible from its seed on every backend. */
typedef struct dflash_sampling_params {
    uint32_t struct_size; /* sizeof(dflash_sampling_params) */
    float temperature;    /* >= 0; default 0 (greedy) */
    float top_p;          /* (0, 1]; default 1 (off) */
    int32_t top_k;        /* >= 0; default 0 (off) */
    uint64_t seed;        /* default 0 */
    int32_t draft_mode;   /* a dflash_draft_mode; default DFLASH_DRAFT_GREEDY */
} dflash_sampling_params;

DFLASH_API dflash_sampling_params dflash_sampling_default_params(void);

/* ------------------------------------------------------------------------------------------ */
/* Target: the model being accelerated (Qwen3 dense, Llama)                                   */
/* ------------------------------------------------------------------------------------------ */

typedef struct dflash_target dflash_target;
typedef struct dflash_target_seq dflash_target_seq;
typedef struct dflash_drafter_seq dflash_drafter_seq;

typedef enum dflash_arch {
    DFLASH_ARCH_QWEN3 = 0, /* Qwen3ForCausalLM: per-head q_norm / k_norm */
    DFLASH_ARCH_LLAMA = 1  /* LlamaForCausalLM: no q/k norm */
} dflash_arch;

typedef struct dflash_target_params {
    uint32_t struct_size;      /* sizeof(dflash_target_params) */
    int32_t arch;              /* a dflash_arch */
    int32_t num_layers;        /* 1..1024 */
    int32_t hidden_size;
    int32_t intermediate_size;
    int32_t num_heads;
    int32_t num_kv_heads;
    int32_t head_dim;          /* even */
    int32_t vocab_size;
    float rms_norm_eps;        /* default 1e-6 */
    int32_t max_position_embeddings; /* default 32768; positions must stay below it */
    dflash_rope_params rope;
    int32_t tie_word_embeddings; /* 1: no "lm_head.weight", embed_tokens is the head */

    /* --- engine sizing --- */
    int32_t max_batch;         /* sequences holding KV at once; default 1 */
    int32_t max_seq_len;       /* largest sequence budget (prompt + output); default 4096 */
    int32_t max_verify_rows;   /* most rows per verify (the widest block); default 16 */
    int32_t prefill_chunk;     /* prompt rows per forward in prefill; default 512 */
} dflash_target_params;

DFLASH_API dflash_target_params dflash_target_default_params(void);

/* Creates an empty target; weights enter with dflash_target_set_tensor, then finalize. Tensor
 * names are the checkpoint's ("model." prefix accepted): "embed_tokens.weight" [V, H],
 * "norm.weight" [H], "lm_head.weight" [V, H] (not with tie_word_embeddings), and per layer i
 * "layers.{i}.input_layernorm.weight", "layers.{i}.post_attention_layernorm.weight" [H],
 * "layers.{i}.self_attn.{q,k,v,o}_proj.weight", "layers.{i}.self_attn.{q,k}_norm.weight" [hd]
 * (Qwen3 only), "layers.{i}.mlp.{gate,up,down}_proj.weight". Same rules as the drafter's. */
DFLASH_API dflash_status dflash_target_create(dflash_context *ctx,
                                              const dflash_target_params *params,
                                              dflash_target **out);
DFLASH_API dflash_status dflash_target_set_tensor(dflash_target *target, const char *name,
                                                  dflash_dtype dtype, int32_t ndim,
                                                  const int64_t *shape, const void *data);
DFLASH_API dflash_status dflash_target_finalize(dflash_target *target);
DFLASH_API dflash_status dflash_target_pool_stats(dflash_target *target, dflash_pool_stats *out);

/* Destroys the handle and every sequence allocated from it. Drafters created for this target
 * keep its shared weights alive until they are destroyed too. NULL is OK. */
DFLASH_API dflash_status dflash_target_destroy(dflash_target *target);

/* A sequence for positions [0, budget_tokens) (0 = max_seq_len). Its paged causal KV cache takes
 * blocks from the target's pool as it grows and gives them back on rollback/reset/free. */
DFLASH_API dflash_status dflash_target_seq_alloc(dflash_target *target, int32_t budget_tokens,
                                                 dflash_target_seq **out);

/* Appends n prompt tokens at positions length..length+n-1 (chunked by prefill_chunk), and
 * chooses the next token from the last row's logits with `sampling` (NULL = greedy) into
 * *out_next_token (not appended: it is the anchor of the next verify). With capture_into, the
 * hidden states after the drafter's target_layer_ids for all n rows are appended to that drafter
 * sequence as context rows (device to device; positions must line up: the drafter sequence's
 * next position must equal this sequence's length). Returns after completion. */
DFLASH_API dflash_status dflash_target_seq_prefill(dflash_target_seq *seq, const int32_t *tokens,
                                                   int32_t n_tokens,
                                                   const dflash_sampling_params *sampling,
                                                   dflash_drafter_seq *capture_into,
                                                   int32_t *out_next_token);

/* Verifies a block: tokens[0] is the anchor (the last chosen token, at position length) and
 * tokens[1..n-1] are drafts. One forward over the n rows, then:
 * - greedy (temperature 0): accepted = the longest prefix with tokens[j] == argmax(row j-1),
 *   next = argmax(row accepted);
 * - sampling: Leviathan rejection sampling (dflash.model._rejection_sample): draft j is accepted
 *   when u * q(tokens[j]) < p_{j-1}(tokens[j]); at the first rejection the next token is drawn
 *   from max(p - q, 0) renormalised, else from p_{n-1}. q is the drafter's proposal when
 *   `drafter_seq` proposed these drafts (one-hot for greedy drafts), else one-hot.
 * The first accepted+1 rows stay in the KV cache (the rest are rolled back) and *out_num_accepted,
 * *out_next_token are set: one small copy back, never the logits. With drafter_seq (which must be
 * awaiting after_verify, and whose last drafts must equal tokens[1..n-1]), the n rows' context
 * features are staged in it; its after_verify(k) then commits the first k+1 as context rows.
 * n ranges over 1..max_verify_rows (n = 1 is a plain autoregressive step). */
DFLASH_API dflash_status dflash_target_seq_verify(dflash_target_seq *seq, const int32_t *tokens,
                                                  int32_t n_tokens,
                                                  const dflash_sampling_params *sampling,
                                                  dflash_drafter_seq *drafter_seq,
                                                  int32_t *out_num_accepted,
                                                  int32_t *out_next_token);

/* Drops the newest n_rows committed tokens from the KV cache (e.g. after a stop token inside an
 * accepted block, or to regenerate). More than the length: DFLASH_STATUS_OUT_OF_RANGE. */
DFLASH_API dflash_status dflash_target_seq_rollback(dflash_target_seq *seq, int32_t n_rows);

typedef struct dflash_target_seq_stats {
    uint32_t struct_size;  /* sizeof(dflash_target_seq_stats), set by the caller */
    int32_t budget_tokens;
    int32_t length;        /* tokens in the KV cache */
    int32_t blocks_held;
    int32_t steps;         /* prefill + verify calls since alloc/reset */
    int32_t graph_replays; /* forwards replayed from a CUDA graph since alloc (0 on host) */
} dflash_target_seq_stats;

DFLASH_API dflash_status dflash_target_seq_info(dflash_target_seq *seq,
                                                dflash_target_seq_stats *out);
DFLASH_API dflash_status dflash_target_seq_reset(dflash_target_seq *seq);
DFLASH_API dflash_status dflash_target_seq_free(dflash_target_seq *seq);

/* ------------------------------------------------------------------------------------------ */
/* Drafter                                                                                    */
/* ------------------------------------------------------------------------------------------ */

typedef struct dflash_drafter dflash_drafter;

typedef struct dflash_drafter_params {
    uint32_t struct_size; /* sizeof(dflash_drafter_params) */

    /* --- the drafter's config.json (as dflash.model reads it) --- */
    int32_t num_layers;        /* num_hidden_layers, 1..DFLASH_MAX_LAYERS */
    int32_t hidden_size;       /* H (also the target's hidden size: embeddings are shared) */
    int32_t intermediate_size; /* I */
    int32_t num_heads;         /* query heads */
    int32_t num_kv_heads;      /* divides num_heads */
    int32_t head_dim;          /* even */
    int32_t vocab_size;        /* rows of the shared embed_tokens / lm_head */
    float rms_norm_eps;        /* default 1e-6 */
    int32_t max_position_embeddings; /* used by yarn/llama3 defaults; default 32768 */
    dflash_rope_params rope;
    int32_t sliding_window;    /* window of sliding layers in positions; 0 = none */
    int32_t is_causal;         /* -1 = unset (sliding layers causal, full layers not), 0, 1 */
    uint8_t layer_types[DFLASH_MAX_LAYERS]; /* dflash_layer_type per layer; default full */
    int32_t block_size;        /* trained block width gamma, 2..; default 16 */
    int32_t mask_token_id;     /* dflash_config.mask_token_id, < vocab_size */
    int32_t num_target_layer_ids;                       /* n_ids, 1..DFLASH_MAX_TARGET_LAYER_IDS */
    int32_t target_layer_ids[DFLASH_MAX_TARGET_LAYER_IDS]; /* target layer whose OUTPUT is tapped */
    int32_t num_target_layers; /* for validating target_layer_ids; 0 = unknown (not checked) */
    int32_t target_hidden_size;/* H_t; features are [n, n_ids * H_t]; 0 = hidden_size */
    float input_embedding_scale;   /* default 1 */
    float output_multiplier;       /* default 1 */
    float final_logit_softcapping; /* 0 = none */
    int32_t tie_word_embeddings;   /* 1: "lm_head.weight" is not given, embed_tokens is used */

    /* --- engine sizing --- */
    int32_t max_batch;       /* sequences that can hold KV at once; default 1 */
    int32_t max_seq_len;     /* largest sequence budget in tokens (positions); default 4096 */
    int32_t ctx_window;      /* 0 = attend to every context row; else keep the newest N rows */
    int32_t ctx_chunk_rows;  /* context rows buffered per sequence before a precompute is forced;
                                0 = max(64, block_size) */
} dflash_drafter_params;

/* Defaults as documented above; model fields are 0 and must be filled in. */
DFLASH_API dflash_drafter_params dflash_drafter_default_params(void);

/* Creates an empty drafter (no weights yet). The params are copied and validated (sizes,
 * divisibility, ids, windows). Weights then enter with dflash_drafter_set_tensor and the drafter
 * becomes usable after dflash_drafter_finalize. *out is owned by the caller. */
DFLASH_API dflash_status dflash_drafter_create(dflash_context *ctx,
                                               const dflash_drafter_params *params,
                                               dflash_drafter **out);

/* Creates a drafter that shares `target`'s context, embed_tokens and lm_head in memory (no copy:
 * do not give those two tensors). The params' hidden_size, vocab_size, target_hidden_size and
 * num_target_layers must agree with the target (a clear DFLASH_STATUS_INVALID_ARGUMENT names the
 * mismatch); target_hidden_size and num_target_layers 0 are filled from the target. The drafter
 * keeps the shared weights alive even if the target is destroyed first. */
DFLASH_API dflash_status dflash_drafter_create_for_target(dflash_target *target,
                                                          const dflash_drafter_params *params,
                                                          dflash_drafter **out);

/* Copies one named tensor into the library (the host pointer is borrowed for the call only).
 * Names are the checkpoint's: "fc.weight" [H, n_ids*H_t], "hidden_norm.weight" [H],
 * "norm.weight" [H], "layers.{i}.input_layernorm.weight" [H],
 * "layers.{i}.post_attention_layernorm.weight" [H], "layers.{i}.self_attn.q_proj.weight"
 * [nh*hd, H], ".k_proj.weight"/".v_proj.weight" [nkv*hd, H], ".o_proj.weight" [H, nh*hd],
 * ".q_norm.weight"/".k_norm.weight" [hd], "layers.{i}.mlp.gate_proj.weight"/"up_proj" [I, H],
 * "down_proj" [H, I]; plus the target's shared "embed_tokens.weight" [V, H] and
 * "lm_head.weight" [V, H] (not with tie_word_embeddings). A "model." prefix is accepted.
 * Unknown name, wrong shape, duplicate or call after finalize: DFLASH_STATUS_BAD_TENSOR /
 * DFLASH_STATUS_INVALID_STATE, the drafter unchanged. */
DFLASH_API dflash_status dflash_drafter_set_tensor(dflash_drafter *drafter, const char *name,
                                                   dflash_dtype dtype, int32_t ndim,
                                                   const int64_t *shape, const void *data);

/* Checks that every tensor is present (the error lists the missing ones), builds the fused
 * [L*2*kv_dim, H] context K/V weight, allocates the KV pool and scratch. After it, the drafter
 * accepts sequences and no more tensors. */
DFLASH_API dflash_status dflash_drafter_finalize(dflash_drafter *drafter);


/* Fills *out (out->struct_size must be set). Valid after finalize. */
DFLASH_API dflash_status dflash_drafter_pool_stats(dflash_drafter *drafter,
                                                   dflash_pool_stats *out);

/* Destroys the drafter and every sequence still allocated from it (their handles become
 * invalid). NULL is OK; a second destroy is DFLASH_STATUS_INVALID_HANDLE. */
DFLASH_API dflash_status dflash_drafter_destroy(dflash_drafter *drafter);

/* --- per-sequence state ------------------------------------------------------------------ */

/* Allocates a sequence that may use positions [0, budget_tokens). budget_tokens 0 = the
 * drafter's max_seq_len; more than max_seq_len is DFLASH_STATUS_CAPACITY. No KV block is taken
 * yet: blocks are taken as context rows arrive (DFLASH_STATUS_POOL_EXHAUSTED then). */
DFLASH_API dflash_status dflash_drafter_seq_alloc(dflash_drafter *drafter, int32_t budget_tokens,
                                                  dflash_drafter_seq **out);

/* Appends n_rows context rows: the target's hidden states after layers target_layer_ids,
 * concatenated per row, [n_rows, n_ids * H_t] row-major in `dtype`. `data` is a host pointer
 * (on_device = 0) or, on the cuda backend, a device pointer of the context's device
 * (on_device = 1; read on the context stream, so the caller orders its producer before). Rows get
 * positions first_pos, first_pos+1, ...; first_pos = -1 continues one past the last row (0 for
 * the first); a larger first_pos leaves a gap. first_pos below the next position is
 * DFLASH_STATUS_OUT_OF_RANGE, positions past the budget DFLASH_STATUS_CAPACITY. Between a propose
 * and its after_verify: DFLASH_STATUS_INVALID_STATE.
 * Rows are buffered and projected lazily (at the next propose, or when ctx_chunk_rows are
 * pending). With ctx_window > 0, rows that cannot be within the window are skipped.
 * Returns after `data` may be reused. */
DFLASH_API dflash_status dflash_drafter_seq_append_context(dflash_drafter_seq *seq,
                                                           const void *data, dflash_dtype dtype,
                                                           int32_t on_device, int32_t n_rows,
                                                           int32_t first_pos);

/* Proposes drafts for the block that starts with `last_token` (the last committed token, not yet
 * seen by the target) at `position`, which must be one past the last context row. The block
 * width is clamp(num_drafts + 1, 2, block_size) (num_drafts >= 0; negative is
 * DFLASH_STATUS_INVALID_ARGUMENT) and must fit the budget: position + width <= budget_tokens,
 * else DFLASH_STATUS_CAPACITY (ask for fewer drafts near the end). width - 1 drafts are written
 * to out_tokens (capacity out_capacity entries; too small is DFLASH_STATUS_CAPACITY) and their
 * count to *out_num_drafts. Pending context rows are projected first (the incremental
 * precompute). Each propose must be followed by after_verify before the next propose or append
 * (else DFLASH_STATUS_INVALID_STATE). Returns after completion. */
DFLASH_API dflash_status dflash_drafter_seq_propose(dflash_drafter_seq *seq, int32_t last_token,
                                                    int32_t position, int32_t num_drafts,
                                                    int32_t *out_tokens, int32_t out_capacity,
                                                    int32_t *out_num_drafts);

/* As dflash_drafter_seq_propose, choosing drafts per `sampling` (NULL or temperature 0 = greedy):
 * DFLASH_DRAFT_SAMPLE draws each draft from the drafter's own distribution and keeps it as the
 * proposal q for dflash_target_seq_verify; DFLASH_DRAFT_GREEDY proposes the argmax. */
DFLASH_API dflash_status dflash_drafter_seq_propose_sampled(dflash_drafter_seq *seq,
                                                            int32_t last_token, int32_t position,
                                                            int32_t num_drafts,
                                                            const dflash_sampling_params *sampling,
                                                            int32_t *out_tokens,
                                                            int32_t out_capacity,
                                                            int32_t *out_num_drafts);

/* Copies the final (normed) hidden states of this sequence's last propose's draft rows, fp32
 * [num_drafts, hidden_size], into out (capacity out_capacity floats). For tests and for callers
 * that sample from their own head. The rows live in the drafter's scratch: they are readable
 * until the next propose of ANY sequence of this drafter, or this sequence's reset; after that,
 * or before any propose, DFLASH_STATUS_INVALID_STATE. */
DFLASH_API dflash_status dflash_drafter_seq_read_hidden(dflash_drafter_seq *seq, float *out,
                                                        int64_t out_capacity,
                                                        int32_t *out_rows);

/* Records that the target accepted num_accepted (0..num_drafts) drafts of the last propose and
 * drops that step's noise slots. If dflash_target_seq_verify staged this step's context features
 * here, the first num_accepted + 1 staged rows (the anchor and the accepted drafts) are committed
 * as context rows; otherwise the caller appends those rows itself. Then propose from the bonus
 * token. Without a pending propose: DFLASH_STATUS_INVALID_STATE. */
DFLASH_API dflash_status dflash_drafter_seq_after_verify(dflash_drafter_seq *seq,
                                                         int32_t num_accepted);

typedef struct dflash_seq_info {
    uint32_t struct_size;     /* sizeof(dflash_seq_info), set by the caller */
    int32_t budget_tokens;    /* positions [0, budget) usable */
    int32_t next_position;    /* one past the last context row's position */
    int64_t context_rows;     /* rows appended since alloc/reset (skipped ones included) */
    int32_t cached_rows;      /* rows whose K/V is in the cache (<= ctx_window when set) */
    int32_t pending_rows;     /* rows buffered, not projected yet */
    int32_t blocks_held;      /* KV blocks held */
    int32_t proposals;        /* proposes since alloc/reset */
    int64_t accepted_drafts;  /* sum of num_accepted over after_verify calls */
    /* Added after ABI v1's first release: a caller whose struct ends before it (struct_size =
     * offsetof(dflash_seq_info, graph_replays)) gets the fields before it. */
    int64_t graph_replays;    /* proposes since alloc/reset whose block replayed a CUDA graph (0 on host) */
} dflash_seq_info;

DFLASH_API dflash_status dflash_drafter_seq_info(dflash_drafter_seq *seq, dflash_seq_info *out);

/* free_state: returns every KV block to the pool and empties the sequence (positions restart at
 * 0) so the handle can be reused with the same budget. */
DFLASH_API dflash_status dflash_drafter_seq_reset(dflash_drafter_seq *seq);

/* Resets and destroys the sequence. NULL is OK; a second free is DFLASH_STATUS_INVALID_HANDLE. */
DFLASH_API dflash_status dflash_drafter_seq_free(dflash_drafter_seq *seq);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_H */
