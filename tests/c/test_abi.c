/*
 * test_abi.c: drives the libdflash C ABI (native/include/dflash.h) end to end on the host backend.
 *
 * Plain C99, no files, no Python: a tiny DFlash drafter is built in memory from a deterministic
 * xorshift PRNG (fp32 tensors, one BF16 and one F16 tensor), then the whole lifecycle, determinism
 * and every documented error path are exercised. Each check group prints one line; "ALL OK" at the
 * end. Exit code = number of failed checks (capped at 100).
 *
 *   cc -std=c99 -Wall -Wextra -Werror -pedantic -I native/include tests/c/test_abi.c \
 *      -L build/dev -ldflash -Wl,-rpath,build/dev -o test_abi && ./test_abi
 *
 * DFLASH_TEST_VERBOSE=1 prints every expected error message as well.
 */
#include "dflash.h"

#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* The tiny model                                                                             */
/* ------------------------------------------------------------------------------------------ */

enum {
    NL = 2,          /* drafter layers */
    HS = 32,         /* hidden size */
    IS = 64,         /* intermediate size */
    NH = 4,          /* query heads */
    NKV = 2,         /* kv heads */
    HD = 16,         /* head dim (NH * HD = 64 != HS on purpose) */
    VOC = 64,        /* vocab */
    BLK = 8,         /* block_size */
    MASK = 63,       /* mask_token_id */
    NIDS = 2,        /* target_layer_ids {0, 2} */
    NTL = 4,         /* num_target_layers */
    HT = 32,         /* target hidden size */
    FEAT = NIDS * HT,
    MAXB = 2,        /* max_batch */
    MAXSEQ = 128,    /* max_seq_len */
    MAX_ROWS = 256   /* rows one append helper call can generate */
};

/* ------------------------------------------------------------------------------------------ */
/* Check machinery                                                                            */
/* ------------------------------------------------------------------------------------------ */

static int g_failures;
static int g_verbose;
static char g_msg[8192];

/* dst = a + b, truncated to cap - 1 characters, always terminated. */
static void join_str(char *dst, size_t cap, const char *a, const char *b)
{
    size_t na = strlen(a), nb = strlen(b);
    if (na > cap - 1) na = cap - 1;
    if (nb > cap - 1 - na) nb = cap - 1 - na;
    memmove(dst, a, na);
    memmove(dst + na, b, nb);
    dst[na + nb] = '\0';
}

/* Copies dflash_last_error() (valid only until the next dflash_* call) into g_msg. */
static const char *grab_error(void)
{
    const char *e = dflash_last_error();
    join_str(g_msg, sizeof g_msg, "", e ? e : "<dflash_last_error() returned NULL>");
    return g_msg;
}

static const char *status_name(int st)
{
    const char *s = dflash_status_string((dflash_status)st);
    return s ? s : "<NULL status string>";
}

static void fail_cond(const char *file, int line, const char *expr)
{
    const char *msg = grab_error();
    g_failures++;
    printf("FAIL %s:%d: CHECK(%s)\n    last_error: \"%s\"\n", file, line, expr, msg);
    fflush(stdout);
}

/* needles: "a|b|c", true if msg contains any alternative. */
static int has_any(const char *msg, const char *needles)
{
    char buf[512];
    const char *p = needles;
    while (*p) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (n >= sizeof buf) n = sizeof buf - 1;
        memcpy(buf, p, n);
        buf[n] = '\0';
        if (n > 0 && strstr(msg, buf) != NULL) return 1;
        if (!bar) break;
        p = bar + 1;
    }
    return 0;
}

/* accept: bit mask of acceptable statuses. For a failure status the message must be non-empty
 * and, when needles is given, mention one of its alternatives. Returns 1 if the check passed. */
static int expect_impl(const char *file, int line, const char *expr, dflash_status got,
                       unsigned accept, const char *needles)
{
    char msg[sizeof g_msg];
    int code = (int)got;
    join_str(msg, sizeof msg, "", grab_error()); /* before any other dflash call */
    if (code < 0 || code > 31 || !(accept & (1u << code))) {
        char wants[512] = "";
        int s;
        for (s = 0; s < 32; s++) {
            if (accept & (1u << s)) {
                if (wants[0]) strcat(wants, " or ");
                strcat(wants, status_name(s));
            }
        }
        g_failures++;
        printf("FAIL %s:%d: %s\n    returned %s (%d), expected %s\n    last_error: \"%s\"\n", file,
               line, expr, status_name(code), code, wants, msg);
        fflush(stdout);
        return 0;
    }
    if (code != 0) {
        if (msg[0] == '\0') {
            g_failures++;
            printf("FAIL %s:%d: %s\n    returned %s as expected but dflash_last_error() is empty\n",
                   file, line, expr, status_name(code));
            fflush(stdout);
            return 0;
        }
        if (needles && !has_any(msg, needles)) {
            g_failures++;
            printf("FAIL %s:%d: %s\n    returned %s as expected but last_error does not mention "
                   "any of \"%s\"\n    last_error: \"%s\"\n",
                   file, line, expr, status_name(code), needles, msg);
            fflush(stdout);
            return 0;
        }
        if (g_verbose) printf("    [%s] %s\n        -> \"%s\"\n", status_name(code), expr, msg);
    }
    return 1;
}

#define CHECK(cond) ((cond) ? 1 : (fail_cond(__FILE__, __LINE__, #cond), 0))
#define CHECK_OK(call) expect_impl(__FILE__, __LINE__, #call, (call), 1u, NULL)
#define EXPECT(call, st, needles) expect_impl(__FILE__, __LINE__, #call, (call), 1u << (st), needles)
#define EXPECT2(call, a, b, needles)                                                                \
    expect_impl(__FILE__, __LINE__, #call, (call), (1u << (a)) | (1u << (b)), needles)
#define EXPECT3(call, a, b, c, needles)                                                             \
    expect_impl(__FILE__, __LINE__, #call, (call), (1u << (a)) | (1u << (b)) | (1u << (c)), needles)

#define S_OK DFLASH_STATUS_OK
#define S_ARG DFLASH_STATUS_INVALID_ARGUMENT
#define S_HANDLE DFLASH_STATUS_INVALID_HANDLE
#define S_STATE DFLASH_STATUS_INVALID_STATE
#define S_RANGE DFLASH_STATUS_OUT_OF_RANGE
#define S_CAP DFLASH_STATUS_CAPACITY
#define S_POOL DFLASH_STATUS_POOL_EXHAUSTED
#define S_TENSOR DFLASH_STATUS_BAD_TENSOR
#define S_NOTSUP DFLASH_STATUS_NOT_SUPPORTED
#define S_NODEV DFLASH_STATUS_NO_DEVICE
#define S_CUDA DFLASH_STATUS_CUDA_ERROR

/* ------------------------------------------------------------------------------------------ */
/* Numbers: PRNG, BF16 / F16 conversion                                                       */
/* ------------------------------------------------------------------------------------------ */

static uint64_t g_rng;

static void rng_seed(uint64_t s)
{
    g_rng = s * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    if (g_rng == 0) g_rng = 1;
}

static uint64_t rng_next(void) /* xorshift64* */
{
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 0x2545F4914F6CDD1Dull;
}

static float rng_uniform(void) /* [-1, 1) */
{
    return (float)((double)(rng_next() >> 40) / 8388608.0 - 1.0);
}

static double my_sqrt(double x)
{
    double r = x > 1.0 ? x : 1.0;
    int i;
    for (i = 0; i < 64; i++) r = 0.5 * (r + x / r);
    return r;
}

static double my_abs(double x) { return x < 0 ? -x : x; }

static uint16_t f32_to_bf16(float f) /* round to nearest even */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0; /* NaN */
    u = u + 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_f16(float f) /* round to nearest even, subnormals included */
{
    uint32_t x, e, m, q, rem;
    int32_t e16;
    uint16_t sign;
    memcpy(&x, &f, 4);
    sign = (uint16_t)((x >> 16) & 0x8000u);
    e = (x >> 23) & 0xFFu;
    m = x & 0x7FFFFFu;
    if (e == 0xFFu) return (uint16_t)(sign | 0x7C00u | (m ? 0x200u : 0u));
    e16 = (int32_t)e - 112;
    if (e16 >= 31) return (uint16_t)(sign | 0x7C00u);
    if (e16 <= 0) {
        uint32_t full = m | 0x800000u, shift, half;
        if (e16 < -10) return sign;
        shift = (uint32_t)(14 - e16);
        q = full >> shift;
        rem = full & ((1u << shift) - 1u);
        half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    q = ((uint32_t)e16 << 10) | (m >> 13);
    rem = m & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3FFu, u;
    float f;
    if (e == 0) {
        f = (float)m / 16777216.0f;
        return sign ? -f : f;
    }
    if (e == 31) u = sign | 0x7F800000u | (m << 13);
    else u = sign | ((e - 15u + 127u) << 23) | (m << 13);
    memcpy(&f, &u, 4);
    return f;
}

enum { ROUND_NONE = 0, ROUND_BF16 = 1, ROUND_F16 = 2 };

static float round_to(float x, int mode)
{
    if (mode == ROUND_BF16) return bf16_to_f32(f32_to_bf16(x));
    if (mode == ROUND_F16) return f16_to_f32(f32_to_f16(x));
    return x;
}

/* ------------------------------------------------------------------------------------------ */
/* Weights                                                                                    */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    char name[96];
    int32_t ndim;
    int64_t shape[2];
    size_t numel;
    float *f32;        /* exact values, already representable in `native` */
    uint16_t *bits;    /* BF16 / F16 bit patterns when native != F32 */
    dflash_dtype native;
} tensor_t;

#define MAX_TENSORS 64
static tensor_t g_w[MAX_TENSORS];
static int g_nw;

enum { KIND_LINEAR, KIND_NORM, KIND_EMBED };

static void add_tensor(const char *name, int64_t d0, int64_t d1, int kind, dflash_dtype native)
{
    tensor_t *t = &g_w[g_nw++];
    size_t i;
    double scale = 1.0;
    join_str(t->name, sizeof t->name, "", name);
    t->ndim = d1 > 0 ? 2 : 1;
    t->shape[0] = d0;
    t->shape[1] = d1 > 0 ? d1 : 0;
    t->numel = (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1);
    t->native = native;
    t->f32 = (float *)malloc(t->numel * sizeof(float));
    t->bits = (uint16_t *)malloc(t->numel * sizeof(uint16_t));
    if (!t->f32 || !t->bits) {
        printf("out of memory\n");
        exit(100);
    }
    if (kind == KIND_LINEAR) scale = my_sqrt(3.0) / my_sqrt((double)d1); /* unit-variance rows */
    if (kind == KIND_EMBED) scale = my_sqrt(3.0);
    for (i = 0; i < t->numel; i++) {
        float x = rng_uniform();
        float v = kind == KIND_NORM ? 1.0f + 0.2f * x : (float)(scale * x);
        if (native == DFLASH_DTYPE_BF16) {
            t->bits[i] = f32_to_bf16(v);
            v = bf16_to_f32(t->bits[i]);
        } else if (native == DFLASH_DTYPE_F16) {
            t->bits[i] = f32_to_f16(v);
            v = f16_to_f32(t->bits[i]);
        }
        t->f32[i] = v;
    }
}

static void build_weights(void)
{
    char name[96];
    int l;
    rng_seed(1234);
    g_nw = 0;
    add_tensor("embed_tokens.weight", VOC, HS, KIND_EMBED, DFLASH_DTYPE_F32);
    add_tensor("lm_head.weight", VOC, HS, KIND_LINEAR, DFLASH_DTYPE_BF16);
    add_tensor("fc.weight", HS, FEAT, KIND_LINEAR, DFLASH_DTYPE_F32);
    add_tensor("hidden_norm.weight", HS, 0, KIND_NORM, DFLASH_DTYPE_F32);
    add_tensor("norm.weight", HS, 0, KIND_NORM, DFLASH_DTYPE_F16);
    for (l = 0; l < NL; l++) {
#define LAYER_T(suffix, d0, d1, kind, dt)                                                           \
    do {                                                                                           \
        sprintf(name, "layers.%d.%s", l, suffix);                                                  \
        add_tensor(name, d0, d1, kind, dt);                                                        \
    } while (0)
        LAYER_T("input_layernorm.weight", HS, 0, KIND_NORM, DFLASH_DTYPE_F32);
        LAYER_T("post_attention_layernorm.weight", HS, 0, KIND_NORM, DFLASH_DTYPE_F32);
        LAYER_T("self_attn.q_proj.weight", NH * HD, HS, KIND_LINEAR,
                l == 0 ? DFLASH_DTYPE_BF16 : DFLASH_DTYPE_F32);
        LAYER_T("self_attn.k_proj.weight", NKV * HD, HS, KIND_LINEAR, DFLASH_DTYPE_F32);
        LAYER_T("self_attn.v_proj.weight", NKV * HD, HS, KIND_LINEAR, DFLASH_DTYPE_F32);
        LAYER_T("self_attn.o_proj.weight", HS, NH * HD, KIND_LINEAR, DFLASH_DTYPE_F32);
        LAYER_T("self_attn.q_norm.weight", HD, 0, KIND_NORM, DFLASH_DTYPE_F32);
        LAYER_T("self_attn.k_norm.weight", HD, 0, KIND_NORM, DFLASH_DTYPE_F32);
        LAYER_T("mlp.gate_proj.weight", IS, HS, KIND_LINEAR, DFLASH_DTYPE_F32);
        LAYER_T("mlp.up_proj.weight", IS, HS, KIND_LINEAR, DFLASH_DTYPE_F32);
        LAYER_T("mlp.down_proj.weight", HS, IS, KIND_LINEAR, DFLASH_DTYPE_F32);
#undef LAYER_T
    }
}

static void free_weights(void)
{
    int i;
    for (i = 0; i < g_nw; i++) {
        free(g_w[i].f32);
        free(g_w[i].bits);
    }
    g_nw = 0;
}

static const tensor_t *find_tensor(const char *name)
{
    int i;
    for (i = 0; i < g_nw; i++)
        if (strcmp(g_w[i].name, name) == 0) return &g_w[i];
    return NULL;
}

static dflash_status set_one(dflash_drafter *d, const tensor_t *t, const char *name, int all_f32)
{
    if (all_f32 || t->native == DFLASH_DTYPE_F32)
        return dflash_drafter_set_tensor(d, name, DFLASH_DTYPE_F32, t->ndim, t->shape, t->f32);
    return dflash_drafter_set_tensor(d, name, t->native, t->ndim, t->shape, t->bits);
}

enum { UP_NATIVE = 0, UP_F32 = 1 };

/* Uploads every tensor except `skip` (and lm_head when tied); `prefixed` goes in as "model.<name>". */
static int upload(dflash_drafter *d, int mode, const char *skip, int tie, const char *prefixed)
{
    int i, ok = 1;
    for (i = 0; i < g_nw; i++) {
        const tensor_t *t = &g_w[i];
        char name[128];
        dflash_status st;
        if (skip && strcmp(t->name, skip) == 0) continue;
        if (tie && strcmp(t->name, "lm_head.weight") == 0) continue;
        join_str(name, sizeof name, prefixed && strcmp(t->name, prefixed) == 0 ? "model." : "", t->name);
        st = set_one(d, t, name, mode == UP_F32);
        if (!expect_impl(__FILE__, __LINE__, name, st, 1u, NULL)) ok = 0;
    }
    return ok;
}

static dflash_drafter_params base_params(void)
{
    dflash_drafter_params p = dflash_drafter_default_params();
    p.num_layers = NL;
    p.hidden_size = HS;
    p.intermediate_size = IS;
    p.num_heads = NH;
    p.num_kv_heads = NKV;
    p.head_dim = HD;
    p.vocab_size = VOC;
    p.block_size = BLK;
    p.mask_token_id = MASK;
    p.num_target_layer_ids = NIDS;
    p.target_layer_ids[0] = 0;
    p.target_layer_ids[1] = 2;
    p.num_target_layers = NTL;
    p.target_hidden_size = HT;
    p.max_batch = MAXB;
    p.max_seq_len = MAXSEQ;
    return p;
}

static int32_t expected_bps(const dflash_drafter_params *p)
{
    int32_t c = (p->ctx_window > 0 && p->ctx_window < p->max_seq_len) ? p->ctx_window : p->max_seq_len;
    return (c + p->block_size + DFLASH_KV_BLOCK_SIZE - 1) / DFLASH_KV_BLOCK_SIZE;
}

/* create + upload + finalize; NULL (after reporting) on failure. */
static dflash_drafter *make_drafter(dflash_context *ctx, const dflash_drafter_params *p, int mode,
                                    int tie)
{
    dflash_drafter *d = NULL;
    if (!CHECK_OK(dflash_drafter_create(ctx, p, &d))) return NULL;
    if (!upload(d, mode, NULL, tie, NULL) || !CHECK_OK(dflash_drafter_finalize(d))) {
        dflash_drafter_destroy(d);
        return NULL;
    }
    return d;
}

static dflash_context *make_host_context(void)
{
    dflash_context_params cp = dflash_context_default_params();
    dflash_context *ctx = NULL;
    cp.backend = DFLASH_BACKEND_HOST;
    if (!CHECK_OK(dflash_context_create(&cp, &ctx))) return NULL;
    return ctx;
}

/* ------------------------------------------------------------------------------------------ */
/* Context rows                                                                               */
/* ------------------------------------------------------------------------------------------ */

static float g_rows_f32[MAX_ROWS * FEAT];
static uint16_t g_rows_16[MAX_ROWS * FEAT];

/* The feature row of absolute position `pos` (a function of seed and pos only). */
static void gen_row(int seed, int32_t pos, float *out, int round_mode)
{
    int j;
    rng_seed((uint64_t)seed * 1000003ull + (uint64_t)pos + 7ull);
    for (j = 0; j < FEAT; j++) out[j] = round_to(1.7f * rng_uniform(), round_mode);
}

/* Appends the rows of positions [pos0, pos0 + n) with first_pos argument `first_pos_arg`. */
static dflash_status append_rows(dflash_drafter_seq *s, int32_t pos0, int32_t n, int32_t first_pos_arg,
                                 int seed, dflash_dtype dt, int round_mode)
{
    int32_t r;
    int j;
    if (n > MAX_ROWS) n = MAX_ROWS;
    for (r = 0; r < n; r++) gen_row(seed, pos0 + r, &g_rows_f32[r * FEAT], round_mode);
    if (dt == DFLASH_DTYPE_F32)
        return dflash_drafter_seq_append_context(s, g_rows_f32, dt, 0, n, first_pos_arg);
    for (r = 0; r < n; r++)
        for (j = 0; j < FEAT; j++)
            g_rows_16[r * FEAT + j] = dt == DFLASH_DTYPE_BF16 ? f32_to_bf16(g_rows_f32[r * FEAT + j])
                                                              : f32_to_f16(g_rows_f32[r * FEAT + j]);
    return dflash_drafter_seq_append_context(s, g_rows_16, dt, 0, n, first_pos_arg);
}

static int32_t clamp_width(int32_t num_drafts)
{
    int32_t w = num_drafts + 1;
    if (w < 2) w = 2;
    if (w > BLK) w = BLK;
    return w;
}

/* Is `tok` an argmax (up to a small tie tolerance) of head @ hidden? */
static int argmax_consistent(const float *hidden, const float *head, int32_t tok)
{
    double best = -1e300, lt = 0.0;
    int v, k;
    for (v = 0; v < VOC; v++) {
        double acc = 0.0;
        for (k = 0; k < HS; k++) acc += (double)hidden[k] * (double)head[v * HS + k];
        if (acc > best) best = acc;
        if (v == tok) lt = acc;
    }
    return lt >= best - 1e-3 * (1.0 + my_abs(best));
}

static int all_finite(const float *x, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

static dflash_seq_info seq_info(dflash_drafter_seq *s)
{
    dflash_seq_info si;
    memset(&si, 0, sizeof si);
    si.struct_size = sizeof si;
    CHECK_OK(dflash_drafter_seq_info(s, &si));
    return si;
}

static dflash_pool_stats pool_stats(dflash_drafter *d)
{
    dflash_pool_stats ps;
    memset(&ps, 0, sizeof ps);
    ps.struct_size = sizeof ps;
    CHECK_OK(dflash_drafter_pool_stats(d, &ps));
    return ps;
}

/* ------------------------------------------------------------------------------------------ */
/* The standard script: prefill, then propose / verify / append steps                         */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    int32_t prefill;         /* rows appended before the first propose */
    int32_t prefill_chunk;   /* rows per append call during the prefill */
    dflash_dtype row_dtype;  /* dtype the rows are handed over in */
    int round_mode;          /* precision the row values are rounded to */
    int seed;                /* row content seed */
    int steps;               /* propose/verify/append rounds (stops early at the budget) */
    int32_t budget;          /* the sequence's budget */
    int32_t ctx_window;      /* the drafter's ctx_window (seq_info checks) */
    int32_t bps;             /* the drafter's blocks_per_sequence */
    int32_t chunk_rows;      /* the drafter's ctx_chunk_rows (0 = unchecked) */
    const float *head;       /* lm_head for the argmax check; NULL skips it */
    dflash_drafter *solo;    /* when this is the only live sequence: pool accounting checks */
} script_cfg;

typedef struct {
    int32_t drafts[1024];
    int n_drafts;
    int steps_done;
    float hidden[BLK * HS];
    int32_t hidden_rows;
    int ok;
} script_out;

static script_cfg default_cfg(void)
{
    script_cfg c;
    memset(&c, 0, sizeof c);
    c.prefill = 15;
    c.prefill_chunk = 10;
    c.row_dtype = DFLASH_DTYPE_F32;
    c.round_mode = ROUND_NONE;
    c.seed = 1;
    c.steps = 12;
    c.budget = MAXSEQ;
    c.bps = (MAXSEQ + BLK + 15) / 16;
    c.head = find_tensor("lm_head.weight")->f32;
    return c;
}

static const int32_t k_nd_table[] = {7, 0, 3, 100, 7, 5, 1, 7, 2, 7, 6, 4, 7};

static void run_script(dflash_drafter_seq *s, const script_cfg *c, script_out *o)
{
    int32_t pos = 0, tok = 5, out[BLK + 4];
    int64_t accepted = 0;
    int step, j;
    dflash_seq_info si;
    memset(o, 0, sizeof *o);
    o->ok = 0;

    /* prefill: first chunk at explicit position 0, the rest with first_pos = -1 */
    while (pos < c->prefill) {
        int32_t n = c->prefill - pos < c->prefill_chunk ? c->prefill - pos : c->prefill_chunk;
        if (!CHECK_OK(append_rows(s, pos, n, pos == 0 ? 0 : -1, c->seed, c->row_dtype, c->round_mode)))
            return;
        pos += n;
        if (c->chunk_rows > 0) {
            si = seq_info(s);
            CHECK(si.pending_rows <= c->chunk_rows);
        }
    }
    si = seq_info(s);
    CHECK(si.next_position == pos);
    CHECK(si.context_rows == pos);
    CHECK(si.proposals == 0);
    if (c->ctx_window == 0) CHECK((int64_t)si.cached_rows + si.pending_rows == si.context_rows);

    for (step = 0; step < c->steps; step++) {
        int32_t nd = k_nd_table[step % (int)(sizeof k_nd_table / sizeof k_nd_table[0])];
        int32_t n = -1, rows = -1, k;
        float hid[BLK * HS];
        if (pos + BLK > c->budget) break;
        for (j = 0; j < BLK + 4; j++) out[j] = -7;
        if (!CHECK_OK(dflash_drafter_seq_propose(s, tok, pos, nd, out, BLK, &n))) return;
        if (!CHECK(n == clamp_width(nd) - 1)) {
            printf("    step %d: num_drafts %d -> %d drafts, expected %d\n", step, nd, n,
                   clamp_width(nd) - 1);
            return;
        }
        for (j = 0; j < n; j++) CHECK(out[j] >= 0 && out[j] < VOC);
        for (j = n; j < BLK + 4; j++) CHECK(out[j] == -7 || j < BLK); /* no write past out_capacity */
        for (j = 0; j < n && o->n_drafts < 1024; j++) o->drafts[o->n_drafts++] = out[j];

        if (!CHECK_OK(dflash_drafter_seq_read_hidden(s, hid, (int64_t)BLK * HS, &rows))) return;
        CHECK(rows == n);
        CHECK(all_finite(hid, (size_t)n * HS));
        if (c->head) {
            for (j = 0; j < n; j++) {
                if (!CHECK(argmax_consistent(&hid[j * HS], c->head, out[j])))
                    printf("    step %d draft %d: token %d is not the argmax of lm_head @ hidden\n",
                           step, j, out[j]);
            }
        }
        memcpy(o->hidden, hid, sizeof hid);
        o->hidden_rows = rows;

        si = seq_info(s);
        CHECK(si.budget_tokens == c->budget);
        CHECK(si.next_position == pos);
        CHECK(si.context_rows == pos);
        CHECK(si.pending_rows == 0);
        CHECK(si.proposals == step + 1);
        CHECK(si.accepted_drafts == accepted);
        if (c->ctx_window == 0) {
            CHECK(si.cached_rows == pos);
        } else {
            CHECK(si.cached_rows > 0 && si.cached_rows <= c->ctx_window);
        }
        CHECK(si.blocks_held >= (si.cached_rows + DFLASH_KV_BLOCK_SIZE - 1) / DFLASH_KV_BLOCK_SIZE);
        CHECK(si.blocks_held <= c->bps);
        if (c->solo) {
            dflash_pool_stats ps = pool_stats(c->solo);
            CHECK(ps.free_blocks == ps.total_blocks - si.blocks_held);
            CHECK(ps.live_sequences == 1);
        }

        k = (int32_t)((step * 5 + 1) % (n + 1));
        if (!CHECK_OK(dflash_drafter_seq_after_verify(s, k))) return;
        accepted += k;
        /* committed: the anchor + k drafts; alternate explicit and continued positions */
        if (!CHECK_OK(append_rows(s, pos, k + 1, (step & 1) ? pos : -1, c->seed, c->row_dtype,
                                  c->round_mode)))
            return;
        pos += k + 1;
        si = seq_info(s);
        CHECK(si.next_position == pos);
        CHECK(si.context_rows == pos);
        CHECK(si.accepted_drafts == accepted);
        CHECK(si.proposals == step + 1);
        if (c->ctx_window == 0) CHECK((int64_t)si.cached_rows + si.pending_rows == si.context_rows);
        if (c->chunk_rows > 0) CHECK(si.pending_rows <= c->chunk_rows);
        tok = (int32_t)(((k < n ? out[k] : out[0]) * 7 + 3) % VOC); /* the "bonus" token */
        o->steps_done = step + 1;
    }
    o->ok = 1;
}

static int same_drafts(const script_out *a, const script_out *b)
{
    return a->ok && b->ok && a->n_drafts == b->n_drafts && a->steps_done == b->steps_done &&
           memcmp(a->drafts, b->drafts, (size_t)a->n_drafts * sizeof(int32_t)) == 0;
}

static double hidden_diff(const script_out *a, const script_out *b)
{
    double m = 0.0;
    int i;
    if (a->hidden_rows != b->hidden_rows) return 1e30;
    for (i = 0; i < a->hidden_rows * HS; i++) {
        double d = my_abs((double)a->hidden[i] - (double)b->hidden[i]);
        if (d > m) m = d;
    }
    return m;
}

/* One whole script on a fresh sequence of d. */
static int script_on(dflash_drafter *d, const script_cfg *c, script_out *o)
{
    dflash_drafter_seq *s = NULL;
    if (!CHECK_OK(dflash_drafter_seq_alloc(d, c->budget == MAXSEQ ? 0 : c->budget, &s))) return 0;
    run_script(s, c, o);
    CHECK_OK(dflash_drafter_seq_free(s));
    return o->ok;
}

/* ------------------------------------------------------------------------------------------ */
/* Groups                                                                                     */
/* ------------------------------------------------------------------------------------------ */

static void group_versions(void)
{
    int s;
    const char *bi;
    CHECK(dflash_abi_version() == DFLASH_ABI_VERSION);
    for (s = 0; s <= 12; s++) {
        const char *n = dflash_status_string((dflash_status)s);
        CHECK(n != NULL && n[0] != '\0');
        CHECK(n != NULL && strncmp(n, "DFLASH_STATUS_", 14) == 0);
    }
    CHECK(strcmp(dflash_status_string(DFLASH_STATUS_OK), "DFLASH_STATUS_OK") == 0);
    CHECK(strcmp(dflash_status_string(DFLASH_STATUS_POOL_EXHAUSTED), "DFLASH_STATUS_POOL_EXHAUSTED") == 0);
    CHECK(strcmp(dflash_status_string(DFLASH_STATUS_INTERNAL), "DFLASH_STATUS_INTERNAL") == 0);
    CHECK(dflash_status_string((dflash_status)999) != NULL);
    CHECK(dflash_status_string((dflash_status)-1) != NULL);
    bi = dflash_build_info();
    CHECK(bi != NULL && bi[0] != '\0');
    CHECK(bi != NULL && strstr(bi, "host") != NULL);
    CHECK(dflash_backend_compiled(DFLASH_BACKEND_HOST) == 1);
    CHECK(dflash_backend_compiled((dflash_backend)42) == 0);
    if (g_verbose && bi) printf("    build_info: %s\n", bi);
}

static void group_converters(void) /* the test's own BF16/F16 helpers */
{
    CHECK(f32_to_bf16(1.0f) == 0x3F80);
    CHECK(f32_to_bf16(1.0f / 3.0f) == 0x3EAB);
    CHECK(f32_to_bf16(bf16_to_f32(0x3F80) + 0.00390625f) == 0x3F80); /* tie 0x3F808000 -> even */
    {
        uint32_t u = 0x3F818000u;
        float f;
        memcpy(&f, &u, 4);
        CHECK(f32_to_bf16(f) == 0x3F82); /* tie, odd -> up */
    }
    CHECK(f32_to_f16(1.0f) == 0x3C00);
    CHECK(f32_to_f16(-2.0f) == 0xC000);
    CHECK(f32_to_f16(65504.0f) == 0x7BFF);
    CHECK(f32_to_f16(65520.0f) == 0x7C00);
    CHECK(f32_to_f16(1.0f / 16777216.0f) == 0x0001);
    CHECK(f32_to_f16(1.0f / 3.0f) == 0x3555);
    CHECK(f16_to_f32(0x3555) == 0.333251953125f);
    CHECK(f16_to_f32(0x0001) == 1.0f / 16777216.0f);
    CHECK(f16_to_f32(0xC000) == -2.0f);
}

static void group_defaults(void)
{
    dflash_context_params cp = dflash_context_default_params();
    dflash_drafter_params p = dflash_drafter_default_params();
    int i, all_full = 1;
    CHECK(cp.struct_size == sizeof(dflash_context_params));
    CHECK(cp.backend == DFLASH_BACKEND_HOST);
    CHECK(cp.device == 0);
    CHECK(cp.stream == 0);
    CHECK(cp.cuda_graphs == 1);
    CHECK(p.struct_size == sizeof(dflash_drafter_params));
    CHECK(p.num_layers == 0 && p.hidden_size == 0 && p.vocab_size == 0);
    CHECK(p.rms_norm_eps == 1e-6f);
    CHECK(p.max_position_embeddings == 32768);
    CHECK(p.rope.type == DFLASH_ROPE_DEFAULT);
    CHECK(p.rope.theta == 10000.0);
    CHECK(p.rope.truncate == 1);
    CHECK(p.rope.low_freq_factor == 1.0);
    CHECK(p.rope.high_freq_factor == 4.0);
    CHECK(p.sliding_window == 0);
    CHECK(p.is_causal == -1);
    for (i = 0; i < DFLASH_MAX_LAYERS; i++)
        if (p.layer_types[i] != DFLASH_LAYER_FULL_ATTENTION) all_full = 0;
    CHECK(all_full);
    CHECK(p.block_size == 16);
    CHECK(p.input_embedding_scale == 1.0f);
    CHECK(p.output_multiplier == 1.0f);
    CHECK(p.final_logit_softcapping == 0.0f);
    CHECK(p.tie_word_embeddings == 0);
    CHECK(p.max_batch == 1);
    CHECK(p.max_seq_len == 4096);
    CHECK(p.ctx_window == 0);
    CHECK(p.ctx_chunk_rows == 0);
    CHECK(strcmp(dflash_last_error(), "") == 0); /* nothing has failed on this thread yet */
}

static void group_lifecycle(void)
{
    dflash_context_params cp = dflash_context_default_params();
    dflash_context *ctx = NULL;
    dflash_drafter_params p = base_params();
    dflash_drafter *d = NULL;
    dflash_drafter_seq *s = NULL;
    dflash_pool_stats ps;
    dflash_seq_info si;
    script_cfg c = default_cfg();
    script_out o1, o2;
    int32_t rows = 0;
    float hid[BLK * HS];

    if (!CHECK_OK(dflash_context_create(&cp, &ctx))) return;
    CHECK(ctx != NULL);
    CHECK_OK(dflash_context_synchronize(ctx));
    if (!CHECK_OK(dflash_drafter_create(ctx, &p, &d))) goto done;
    CHECK(d != NULL);
    /* every tensor, "norm.weight" through the accepted "model." prefix */
    if (!upload(d, UP_NATIVE, NULL, 0, "norm.weight")) goto done;
    if (!CHECK_OK(dflash_drafter_finalize(d))) goto done;

    ps = pool_stats(d);
    CHECK(ps.block_size == DFLASH_KV_BLOCK_SIZE);
    CHECK(ps.blocks_per_sequence == expected_bps(&p));
    CHECK(ps.blocks_per_sequence == 9);
    CHECK(ps.total_blocks == MAXB * ps.blocks_per_sequence + 1);
    CHECK(ps.free_blocks == ps.total_blocks);
    CHECK(ps.live_sequences == 0);

    if (!CHECK_OK(dflash_drafter_seq_alloc(d, 0, &s))) goto done;
    CHECK(s != NULL);
    si = seq_info(s);
    CHECK(si.budget_tokens == MAXSEQ);
    CHECK(si.next_position == 0 && si.context_rows == 0 && si.cached_rows == 0 &&
          si.pending_rows == 0 && si.blocks_held == 0 && si.proposals == 0 && si.accepted_drafts == 0);
    ps = pool_stats(d);
    CHECK(ps.live_sequences == 1);
    CHECK(ps.free_blocks == ps.total_blocks); /* no block before a row arrives */

    c.solo = d;
    run_script(s, &c, &o1);
    CHECK(o1.ok && o1.steps_done == c.steps);
    si = seq_info(s);
    CHECK(si.blocks_held > 0);
    ps = pool_stats(d);
    CHECK(ps.free_blocks == ps.total_blocks - si.blocks_held);

    CHECK_OK(dflash_context_synchronize(ctx));

    /* reset: blocks back, positions restart, nothing proposed */
    CHECK_OK(dflash_drafter_seq_reset(s));
    si = seq_info(s);
    CHECK(si.budget_tokens == MAXSEQ);
    CHECK(si.next_position == 0 && si.context_rows == 0 && si.cached_rows == 0 &&
          si.pending_rows == 0 && si.blocks_held == 0 && si.proposals == 0 && si.accepted_drafts == 0);
    ps = pool_stats(d);
    CHECK(ps.free_blocks == ps.total_blocks);
    CHECK(ps.live_sequences == 1);
    EXPECT(dflash_drafter_seq_read_hidden(s, hid, (int64_t)BLK * HS, &rows), S_STATE, NULL);
    EXPECT(dflash_drafter_seq_after_verify(s, 0), S_STATE, NULL);

    /* the same script after reset reproduces the same drafts bit for bit */
    run_script(s, &c, &o2);
    CHECK(same_drafts(&o1, &o2));
    CHECK(o1.hidden_rows == o2.hidden_rows &&
          memcmp(o1.hidden, o2.hidden, sizeof(float) * (size_t)o1.hidden_rows * HS) == 0);

    CHECK_OK(dflash_drafter_seq_free(s));
    EXPECT(dflash_drafter_seq_free(s), S_HANDLE, NULL);
    s = NULL;
    ps = pool_stats(d);
    CHECK(ps.free_blocks == ps.total_blocks);
    CHECK(ps.live_sequences == 0);

done:
    if (d) {
        CHECK_OK(dflash_drafter_destroy(d));
        EXPECT(dflash_drafter_destroy(d), S_HANDLE, NULL);
    }
    CHECK_OK(dflash_context_destroy(ctx));
    EXPECT(dflash_context_destroy(ctx), S_HANDLE, NULL);
}

static void group_determinism(void)
{
    dflash_context *ctx = make_host_context();
    dflash_drafter_params p = base_params();
    dflash_drafter *a = NULL, *b = NULL, *f = NULL, *ch = NULL;
    dflash_drafter_seq *noise = NULL, *s2 = NULL;
    script_cfg c = default_cfg();
    script_out oa, ob, of, ox;
    int32_t out[BLK], n = 0;
    if (!ctx) return;

    a = make_drafter(ctx, &p, UP_NATIVE, 0);
    b = make_drafter(ctx, &p, UP_NATIVE, 0);
    f = make_drafter(ctx, &p, UP_F32, 0); /* the BF16/F16 tensors handed over as their exact fp32 */
    if (!a || !b || !f) goto done;

    /* two drafters from the same weights: identical drafts and hidden states */
    script_on(a, &c, &oa);
    script_on(b, &c, &ob);
    CHECK(same_drafts(&oa, &ob));
    CHECK(hidden_diff(&oa, &ob) == 0.0);

    /* dtype of the weights does not matter when the values are the same */
    script_on(f, &c, &of);
    CHECK(same_drafts(&oa, &of));
    CHECK(hidden_diff(&oa, &of) <= 1e-4);

    /* chunking of the context appends does not matter (incremental precompute) */
    c.prefill_chunk = 1;
    script_on(a, &c, &ox);
    CHECK(same_drafts(&oa, &ox));
    CHECK(hidden_diff(&oa, &ox) <= 1e-4);
    c.prefill_chunk = 15;
    script_on(a, &c, &ox);
    CHECK(same_drafts(&oa, &ox));
    CHECK(hidden_diff(&oa, &ox) <= 1e-4);
    c.prefill_chunk = 10;

    /* a small ctx_chunk_rows forces precomputes inside appends; same results */
    p.ctx_chunk_rows = 4;
    ch = make_drafter(ctx, &p, UP_NATIVE, 0);
    p.ctx_chunk_rows = 0;
    if (ch) {
        c.chunk_rows = 4;
        script_on(ch, &c, &ox);
        c.chunk_rows = 0;
        CHECK(same_drafts(&oa, &ox));
        CHECK(hidden_diff(&oa, &ox) <= 1e-4);
    }

    /* BF16 / F16 context rows == fp32 rows of the same values */
    c.round_mode = ROUND_BF16;
    c.row_dtype = DFLASH_DTYPE_F32;
    script_on(a, &c, &oa);
    c.row_dtype = DFLASH_DTYPE_BF16;
    script_on(a, &c, &ox);
    CHECK(same_drafts(&oa, &ox));
    CHECK(hidden_diff(&oa, &ox) <= 1e-4);
    c.round_mode = ROUND_F16;
    c.row_dtype = DFLASH_DTYPE_F32;
    script_on(a, &c, &oa);
    c.row_dtype = DFLASH_DTYPE_F16;
    script_on(a, &c, &ox);
    CHECK(same_drafts(&oa, &ox));
    CHECK(hidden_diff(&oa, &ox) <= 1e-4);
    c.round_mode = ROUND_NONE;
    c.row_dtype = DFLASH_DTYPE_F32;

    /* isolation: another live sequence with other content (holding the first blocks) changes
     * nothing */
    script_on(a, &c, &oa);
    if (CHECK_OK(dflash_drafter_seq_alloc(a, 0, &noise))) {
        float h1[BLK * HS], h2[BLK * HS];
        int32_t r1 = 0, r2 = 0;
        CHECK_OK(append_rows(noise, 0, 40, 0, 99, DFLASH_DTYPE_F32, ROUND_NONE));
        CHECK_OK(dflash_drafter_seq_propose(noise, 11, 40, 7, out, BLK, &n));
        CHECK_OK(dflash_drafter_seq_read_hidden(noise, h1, (int64_t)BLK * HS, &r1));
        if (CHECK_OK(dflash_drafter_seq_alloc(a, 0, &s2))) {
            run_script(s2, &c, &ox);
            CHECK(same_drafts(&oa, &ox));
            CHECK(hidden_diff(&oa, &ox) == 0.0);
            CHECK_OK(dflash_drafter_seq_free(s2));
        }
        /* the hidden rows live in the drafter's scratch: another sequence's propose since makes
         * them unreadable (documented), with a clear INVALID_STATE rather than stale data */
        CHECK(r1 == 7);
        EXPECT(dflash_drafter_seq_read_hidden(noise, h2, (int64_t)BLK * HS, &r2), S_STATE,
               "another sequence proposed");
        CHECK(r2 == 0);
        CHECK_OK(dflash_drafter_seq_after_verify(noise, 2));
        CHECK_OK(append_rows(noise, 40, 3, -1, 99, DFLASH_DTYPE_F32, ROUND_NONE));
        CHECK_OK(dflash_drafter_seq_propose(noise, 12, 43, 7, out, BLK, &n));
        CHECK(n == BLK - 1);
        CHECK_OK(dflash_drafter_seq_free(noise));
    }
    {
        dflash_pool_stats ps = pool_stats(a);
        CHECK(ps.free_blocks == ps.total_blocks && ps.live_sequences == 0);
    }

done:
    CHECK_OK(dflash_drafter_destroy(a));
    CHECK_OK(dflash_drafter_destroy(b));
    CHECK_OK(dflash_drafter_destroy(f));
    CHECK_OK(dflash_drafter_destroy(ch));
    CHECK_OK(dflash_context_destroy(ctx));
}

/* Other documented configurations: tied embeddings, ctx_window ring + sliding layers, rope types,
 * scaling knobs. Each must finalize, propose in-range drafts consistent with the head, and be
 * deterministic across a reset. */
static void variant(dflash_context *ctx, const char *what, const dflash_drafter_params *p, int tie,
                    int32_t prefill, int steps)
{
    dflash_drafter *d = make_drafter(ctx, p, UP_NATIVE, tie);
    script_cfg c = default_cfg();
    script_out o1, o2;
    dflash_pool_stats ps;
    if (!d) {
        printf("    variant %s: could not be built\n", what);
        return;
    }
    ps = pool_stats(d);
    CHECK(ps.blocks_per_sequence == expected_bps(p));
    CHECK(ps.total_blocks == p->max_batch * ps.blocks_per_sequence + 1);
    CHECK(ps.free_blocks == ps.total_blocks);
    c.prefill = prefill;
    c.prefill_chunk = 50;
    c.steps = steps;
    c.budget = p->max_seq_len;
    c.ctx_window = p->ctx_window;
    c.bps = ps.blocks_per_sequence;
    c.head = find_tensor(tie ? "embed_tokens.weight" : "lm_head.weight")->f32;
    c.solo = d;
    {
        dflash_drafter_seq *s = NULL;
        if (CHECK_OK(dflash_drafter_seq_alloc(d, 0, &s))) {
            run_script(s, &c, &o1);
            if (!CHECK(o1.ok)) printf("    variant %s failed\n", what);
            CHECK_OK(dflash_drafter_seq_reset(s));
            run_script(s, &c, &o2);
            if (!CHECK(same_drafts(&o1, &o2))) printf("    variant %s not deterministic\n", what);
            CHECK_OK(dflash_drafter_seq_free(s));
        }
    }
    ps = pool_stats(d);
    CHECK(ps.free_blocks == ps.total_blocks && ps.live_sequences == 0);
    CHECK_OK(dflash_drafter_destroy(d));
}

static void group_variants(void)
{
    dflash_context *ctx = make_host_context();
    dflash_drafter_params p;
    if (!ctx) return;

    p = base_params();
    p.tie_word_embeddings = 1;
    variant(ctx, "tied", &p, 1, 15, 12);

    /* ring: ctx_window 32 with a sliding layer; long sequence so the ring wraps several times */
    p = base_params();
    p.ctx_window = 32;
    p.max_seq_len = 512;
    p.layer_types[1] = DFLASH_LAYER_SLIDING_ATTENTION;
    p.sliding_window = 24;
    variant(ctx, "ctx_window", &p, 0, 50, 80);

    p = base_params();
    p.layer_types[0] = DFLASH_LAYER_SLIDING_ATTENTION;
    p.sliding_window = 8;
    p.is_causal = 1;
    variant(ctx, "sliding+causal", &p, 0, 30, 12);

    p = base_params();
    p.rope.type = DFLASH_ROPE_YARN;
    p.rope.factor = 4.0;
    p.rope.original_max_position = 32;
    p.max_position_embeddings = 128;
    variant(ctx, "yarn", &p, 0, 15, 12);

    p = base_params();
    p.rope.type = DFLASH_ROPE_LLAMA3;
    p.rope.factor = 8.0;
    p.rope.original_max_position = 32;
    p.rope.theta = 500000.0;
    variant(ctx, "llama3", &p, 0, 15, 12);

    p = base_params();
    p.input_embedding_scale = 2.0f;
    p.output_multiplier = 0.5f;
    p.final_logit_softcapping = 30.0f;
    p.rms_norm_eps = 1e-5f;
    variant(ctx, "scales", &p, 0, 15, 12);

    p = base_params();
    p.num_target_layer_ids = 1;
    p.target_layer_ids[0] = 3;
    p.target_hidden_size = 0; /* = hidden_size: features are [n, 1 * 32], fc.weight is [32, 32] */
    {
        /* fc.weight has another shape here, so this one is built by hand */
        dflash_drafter *d = NULL;
        if (CHECK_OK(dflash_drafter_create(ctx, &p, &d))) {
            int64_t fc_shape[2] = {HS, HS};
            const tensor_t *fc = find_tensor("fc.weight");
            int i, ok = 1;
            for (i = 0; i < g_nw; i++) {
                if (strcmp(g_w[i].name, "fc.weight") == 0) continue;
                if (set_one(d, &g_w[i], g_w[i].name, 0) != DFLASH_STATUS_OK) ok = 0;
            }
            CHECK(ok);
            /* the fp32 fc data is [HS, FEAT]; its first HS*HS values serve as [HS, HS] */
            CHECK_OK(dflash_drafter_set_tensor(d, "fc.weight", DFLASH_DTYPE_F32, 2, fc_shape, fc->f32));
            if (CHECK_OK(dflash_drafter_finalize(d))) {
                dflash_drafter_seq *s = NULL;
                int32_t out[BLK], n = 0;
                if (CHECK_OK(dflash_drafter_seq_alloc(d, 0, &s))) {
                    /* [10, HS] rows: the first HS features of the usual rows */
                    float rows[10 * HS];
                    int r, j;
                    for (r = 0; r < 10; r++) {
                        gen_row(5, r, g_rows_f32, ROUND_NONE);
                        for (j = 0; j < HS; j++) rows[r * HS + j] = g_rows_f32[j];
                    }
                    CHECK_OK(dflash_drafter_seq_append_context(s, rows, DFLASH_DTYPE_F32, 0, 10, 0));
                    CHECK_OK(dflash_drafter_seq_propose(s, 3, 10, 7, out, BLK, &n));
                    CHECK(n == BLK - 1);
                    CHECK_OK(dflash_drafter_seq_free(s));
                }
            }
            CHECK_OK(dflash_drafter_destroy(d));
        }
    }
    CHECK_OK(dflash_context_destroy(ctx));
}

static void group_struct_size_and_null(void)
{
    dflash_context_params cp = dflash_context_default_params();
    dflash_context *ctx = NULL;
    dflash_drafter_params p = base_params();
    dflash_drafter *d = NULL;
    dflash_drafter_seq *s = NULL;
    dflash_pool_stats ps;
    dflash_seq_info si;
    int32_t out[BLK], n = 0, rows = 0, cnt = 0;
    float hid[BLK * HS];
    const tensor_t *t = find_tensor("norm.weight");

    EXPECT(dflash_context_create(NULL, &ctx), S_ARG, "params");
    EXPECT(dflash_context_create(&cp, NULL), S_ARG, "out");
    cp.struct_size = 0;
    EXPECT(dflash_context_create(&cp, &ctx), S_ARG, "struct_size");
    cp.struct_size = (uint32_t)sizeof cp + 8u;
    EXPECT(dflash_context_create(&cp, &ctx), S_ARG, "struct_size");
    cp = dflash_context_default_params();
    cp.backend = (dflash_backend)42;
    EXPECT(dflash_context_create(&cp, &ctx), S_ARG, "backend|42");
    CHECK(ctx == NULL); /* no handle out of a failed create */
    cp = dflash_context_default_params();
    if (!dflash_backend_compiled(DFLASH_BACKEND_CUDA)) {
        cp.backend = DFLASH_BACKEND_CUDA;
        EXPECT(dflash_context_create(&cp, &ctx), S_NOTSUP, "cuda|CUDA");
        EXPECT(dflash_cuda_device_count(&cnt), S_NOTSUP, "cuda|CUDA");
        cp.backend = DFLASH_BACKEND_HOST;
    }
    if (!CHECK_OK(dflash_context_create(&cp, &ctx))) return;

    EXPECT(dflash_drafter_create(ctx, NULL, &d), S_ARG, "params");
    EXPECT(dflash_drafter_create(ctx, &p, NULL), S_ARG, "out");
    EXPECT(dflash_drafter_create(NULL, &p, &d), S_HANDLE, NULL);
    p.struct_size = 0;
    EXPECT(dflash_drafter_create(ctx, &p, &d), S_ARG, "struct_size");
    p.struct_size = 3;
    EXPECT(dflash_drafter_create(ctx, &p, &d), S_ARG, "struct_size");
    p.struct_size = (uint32_t)sizeof p + 64u;
    EXPECT(dflash_drafter_create(ctx, &p, &d), S_ARG, "struct_size");
    p = base_params();
    if (!CHECK_OK(dflash_drafter_create(ctx, &p, &d))) goto done;

    EXPECT(dflash_drafter_set_tensor(d, NULL, DFLASH_DTYPE_F32, 1, t->shape, t->f32), S_ARG, "name");
    EXPECT(dflash_drafter_set_tensor(d, "norm.weight", DFLASH_DTYPE_F32, 1, NULL, t->f32), S_ARG,
           "shape");
    EXPECT(dflash_drafter_set_tensor(d, "norm.weight", DFLASH_DTYPE_F32, 1, t->shape, NULL), S_ARG,
           "data");
    EXPECT(dflash_drafter_set_tensor(d, "norm.weight", (dflash_dtype)7, 1, t->shape, t->f32), S_ARG,
           "dtype|7");
    if (!upload(d, UP_NATIVE, NULL, 0, NULL) || !CHECK_OK(dflash_drafter_finalize(d))) goto done;

    EXPECT(dflash_drafter_pool_stats(d, NULL), S_ARG, "out");
    memset(&ps, 0, sizeof ps);
    EXPECT(dflash_drafter_pool_stats(d, &ps), S_ARG, "struct_size");
    ps.struct_size = (uint32_t)sizeof ps + 4u;
    EXPECT(dflash_drafter_pool_stats(d, &ps), S_ARG, "struct_size");
    EXPECT(dflash_drafter_seq_alloc(d, 0, NULL), S_ARG, "out");
    if (!CHECK_OK(dflash_drafter_seq_alloc(d, 0, &s))) goto done;

    EXPECT(dflash_drafter_seq_append_context(s, NULL, DFLASH_DTYPE_F32, 0, 4, -1), S_ARG, "data|features");
    EXPECT(dflash_drafter_seq_info(s, NULL), S_ARG, "out");
    memset(&si, 0, sizeof si);
    EXPECT(dflash_drafter_seq_info(s, &si), S_ARG, "struct_size");
    CHECK_OK(append_rows(s, 0, 12, -1, 1, DFLASH_DTYPE_F32, ROUND_NONE));
    EXPECT(dflash_drafter_seq_propose(s, 3, 12, 7, NULL, BLK, &n), S_ARG, "out_tokens");
    EXPECT(dflash_drafter_seq_propose(s, 3, 12, 7, out, BLK, NULL), S_ARG, "out_num_drafts");
    si = seq_info(s);
    CHECK(si.proposals == 0 && si.next_position == 12);
    CHECK_OK(dflash_drafter_seq_propose(s, 3, 12, 7, out, BLK, &n));
    {   /* a caller built before graph_replays: the fields before it, nothing written past them */
        dflash_seq_info old, now = seq_info(s);
        memset(&old, 0x5a, sizeof old);
        old.struct_size = (uint32_t)offsetof(dflash_seq_info, graph_replays);
        CHECK_OK(dflash_drafter_seq_info(s, &old));
        CHECK(old.struct_size == offsetof(dflash_seq_info, graph_replays));
        CHECK(old.proposals == 1 && old.next_position == now.next_position &&
              old.accepted_drafts == now.accepted_drafts && old.blocks_held == now.blocks_held);
        memset(&now, 0x5a, sizeof now);
        CHECK(memcmp(&old.graph_replays, &now.graph_replays, sizeof old.graph_replays) == 0);
        old.struct_size = (uint32_t)offsetof(dflash_seq_info, graph_replays) - 8u;
        EXPECT(dflash_drafter_seq_info(s, &old), S_ARG, "struct_size");
        CHECK(seq_info(s).graph_replays == 0); /* host: no graphs */
    }
    EXPECT(dflash_drafter_seq_read_hidden(s, NULL, (int64_t)BLK * HS, &rows), S_ARG, "out");
    EXPECT(dflash_drafter_seq_read_hidden(s, hid, (int64_t)BLK * HS, NULL), S_ARG, "out_rows");
    CHECK_OK(dflash_drafter_seq_read_hidden(s, hid, (int64_t)BLK * HS, &rows));
    CHECK(rows == n);
    CHECK_OK(dflash_drafter_seq_after_verify(s, 1));
    CHECK_OK(dflash_drafter_seq_free(s));

done:
    CHECK_OK(dflash_drafter_destroy(d));
    CHECK_OK(dflash_context_destroy(ctx));
}

static void group_bad_params(void)
{
    dflash_context *ctx = make_host_context();
    dflash_drafter_params p;
    dflash_drafter *d = NULL;
    if (!ctx) return;

#define BAD(mutation, needles)                                                                      \
    do {                                                                                           \
        p = base_params();                                                                         \
        mutation;                                                                                  \
        d = NULL;                                                                                  \
        EXPECT(dflash_drafter_create(ctx, &p, &d), S_ARG, needles);                                \
        CHECK(d == NULL);                                                                          \
        if (d) dflash_drafter_destroy(d);                                                          \
    } while (0)

    BAD(p.num_kv_heads = 3, "num_kv_heads|num_heads");
    BAD(p.head_dim = 15, "head_dim|15");
    BAD(p.mask_token_id = VOC, "mask_token_id|64");
    BAD(p.mask_token_id = -1, "mask_token_id|-1");
    BAD(p.target_layer_ids[1] = 7, "target_layer|7");
    BAD(p.target_layer_ids[0] = -2, "target_layer|-2");
    BAD(p.num_layers = 0, "num_layers");
    BAD(p.num_layers = DFLASH_MAX_LAYERS + 1, "num_layers|129");
    BAD(p.hidden_size = 0, "hidden_size");
    BAD(p.num_heads = 0, "num_heads");
    BAD(p.num_kv_heads = 0, "num_kv_heads");
    BAD(p.vocab_size = 0, "vocab_size|mask_token_id");
    BAD(p.block_size = 1, "block_size");
    BAD(p.num_target_layer_ids = 0, "num_target_layer_ids|target_layer");
    BAD(p.num_target_layer_ids = DFLASH_MAX_TARGET_LAYER_IDS + 1, "num_target_layer_ids|33");
    BAD(p.max_batch = 0, "max_batch");
    BAD(p.max_seq_len = 0, "max_seq_len");
    BAD(p.ctx_window = -4, "ctx_window|-4");
    BAD(p.layer_types[0] = 9, "layer_types|9");
    BAD(p.rope.type = (dflash_rope_type)9, "rope|9");
#undef BAD

    /* after all that, a valid create still works */
    p = base_params();
    if (CHECK_OK(dflash_drafter_create(ctx, &p, &d))) CHECK_OK(dflash_drafter_destroy(d));
    CHECK_OK(dflash_context_destroy(ctx));
}

static void group_tensors(void)
{
    dflash_context *ctx = make_host_context();
    dflash_drafter_params p = base_params();
    dflash_drafter *d = NULL;
    dflash_drafter_seq *s = NULL;
    dflash_pool_stats ps;
    const tensor_t *q = find_tensor("layers.0.self_attn.q_proj.weight");
    const tensor_t *nw = find_tensor("hidden_norm.weight");
    const char *missing = "layers.1.mlp.down_proj.weight";
    int64_t bad_shape[2] = {48, HS};
    int64_t norm2d[2] = {HS, 1};
    int32_t out[BLK], n = 0;
    if (!ctx) return;
    if (!CHECK_OK(dflash_drafter_create(ctx, &p, &d))) goto done;

    /* before finalize: no pool, no sequences */
    memset(&ps, 0, sizeof ps);
    ps.struct_size = sizeof ps;
    EXPECT(dflash_drafter_pool_stats(d, &ps), S_STATE, "finaliz");
    EXPECT(dflash_drafter_seq_alloc(d, 0, &s), S_STATE, "finaliz");
    CHECK(s == NULL);

    EXPECT(dflash_drafter_set_tensor(d, "layers.0.self_attn.qq_proj.weight", DFLASH_DTYPE_F32, 2,
                                     q->shape, q->f32),
           S_TENSOR, "layers.0.self_attn.qq_proj.weight");
    EXPECT(dflash_drafter_set_tensor(d, "layers.2.self_attn.q_proj.weight", DFLASH_DTYPE_F32, 2,
                                     q->shape, q->f32),
           S_TENSOR, "layers.2.self_attn.q_proj.weight");
    {
        /* misshaped: message names the tensor and both shapes ([48, 32] given, [64, 32] expected) */
        const char *m;
        EXPECT(dflash_drafter_set_tensor(d, "layers.0.self_attn.q_proj.weight", DFLASH_DTYPE_F32, 2,
                                         bad_shape, q->f32),
               S_TENSOR, "layers.0.self_attn.q_proj.weight");
        m = g_msg; /* still the copy made by expect_impl */
        CHECK(has_any(m, "48, 32|48,32|48x32|48 x 32"));
        CHECK(has_any(m, "64, 32|64,32|64x32|64 x 32"));
        if (!has_any(m, "48, 32|48,32|48x32|48 x 32") || !has_any(m, "64, 32|64,32|64x32|64 x 32"))
            printf("    misshaped message: \"%s\"\n", m);
    }
    EXPECT(dflash_drafter_set_tensor(d, "hidden_norm.weight", DFLASH_DTYPE_F32, 2, norm2d, nw->f32),
           S_TENSOR, "hidden_norm.weight");
    EXPECT2(dflash_drafter_set_tensor(d, "hidden_norm.weight", DFLASH_DTYPE_F32, 0, nw->shape, nw->f32),
            S_TENSOR, S_ARG, "hidden_norm.weight|ndim");
    /* the failures changed nothing: the right q_proj still goes in, and only once */
    CHECK_OK(dflash_drafter_set_tensor(d, "layers.0.self_attn.q_proj.weight", q->native, 2, q->shape,
                                       q->bits));
    EXPECT(dflash_drafter_set_tensor(d, "layers.0.self_attn.q_proj.weight", DFLASH_DTYPE_F32, 2,
                                     q->shape, q->f32),
           S_TENSOR, "layers.0.self_attn.q_proj.weight");
    /* "model." prefix names the same tensor: a duplicate too */
    EXPECT(dflash_drafter_set_tensor(d, "model.layers.0.self_attn.q_proj.weight", DFLASH_DTYPE_F32, 2,
                                     q->shape, q->f32),
           S_TENSOR, "q_proj");

    /* everything else but one */
    {
        int i, ok = 1;
        for (i = 0; i < g_nw; i++) {
            if (strcmp(g_w[i].name, "layers.0.self_attn.q_proj.weight") == 0) continue;
            if (strcmp(g_w[i].name, missing) == 0) continue;
            if (!expect_impl(__FILE__, __LINE__, g_w[i].name, set_one(d, &g_w[i], g_w[i].name, 0), 1u,
                             NULL))
                ok = 0;
        }
        if (!ok) goto done;
    }
    EXPECT(dflash_drafter_finalize(d), S_TENSOR, missing);
    EXPECT(dflash_drafter_seq_alloc(d, 0, &s), S_STATE, NULL); /* still not finalized */
    CHECK_OK(set_one(d, find_tensor(missing), missing, 0));
    if (!CHECK_OK(dflash_drafter_finalize(d))) goto done;

    /* after finalize: no more tensors, of any kind */
    EXPECT(dflash_drafter_set_tensor(d, "norm.weight", DFLASH_DTYPE_F32, 1, nw->shape, nw->f32), S_STATE,
           "finaliz|norm.weight");
    EXPECT(dflash_drafter_set_tensor(d, "bogus.weight", DFLASH_DTYPE_F32, 1, nw->shape, nw->f32),
           S_STATE, "finaliz|bogus.weight");

    /* and it works */
    if (CHECK_OK(dflash_drafter_seq_alloc(d, 0, &s))) {
        CHECK_OK(append_rows(s, 0, 9, 0, 1, DFLASH_DTYPE_F32, ROUND_NONE));
        CHECK_OK(dflash_drafter_seq_propose(s, 1, 9, 3, out, BLK, &n));
        CHECK(n == 3);
        CHECK_OK(dflash_drafter_seq_free(s));
    }

done:
    CHECK_OK(dflash_drafter_destroy(d));

    /* tied embeddings: finalize does not want lm_head */
    p = base_params();
    p.tie_word_embeddings = 1;
    d = NULL;
    if (CHECK_OK(dflash_drafter_create(ctx, &p, &d))) {
        upload(d, UP_NATIVE, "embed_tokens.weight", 1, NULL);
        EXPECT(dflash_drafter_finalize(d), S_TENSOR, "embed_tokens.weight");
        CHECK_OK(set_one(d, find_tensor("embed_tokens.weight"), "embed_tokens.weight", 0));
        CHECK_OK(dflash_drafter_finalize(d));
        CHECK_OK(dflash_drafter_destroy(d));
    }
    CHECK_OK(dflash_context_destroy(ctx));
}

static void group_sequence_errors(void)
{
    dflash_context *ctx = make_host_context();
    dflash_drafter_params p = base_params();
    dflash_drafter *d = NULL;
    dflash_drafter_seq *s = NULL, *sb = NULL;
    dflash_seq_info si;
    dflash_pool_stats ps;
    int32_t out[BLK], n = 0, rows = 0;
    float hid[BLK * HS];
    if (!ctx) return;
    d = make_drafter(ctx, &p, UP_NATIVE, 0);
    if (!d) goto done;

    EXPECT(dflash_drafter_seq_alloc(d, MAXSEQ + 1, &s), S_CAP, "129|budget");
    CHECK(s == NULL);
    EXPECT3(dflash_drafter_seq_alloc(d, -5, &s), S_ARG, S_RANGE, S_CAP, "-5|budget");
    if (!CHECK_OK(dflash_drafter_seq_alloc(d, 0, &s))) goto done;

    EXPECT(dflash_drafter_seq_read_hidden(s, hid, (int64_t)BLK * HS, &rows), S_STATE,
           "propose|read_hidden");
    EXPECT(dflash_drafter_seq_after_verify(s, 0), S_STATE, "propose|pending|after_verify");

    CHECK_OK(append_rows(s, 0, 10, 0, 1, DFLASH_DTYPE_F32, ROUND_NONE));
    EXPECT(append_rows(s, 5, 2, 5, 1, DFLASH_DTYPE_F32, ROUND_NONE), S_RANGE, "first_pos|5");
    EXPECT(append_rows(s, 0, 2, 0, 1, DFLASH_DTYPE_F32, ROUND_NONE), S_RANGE, "first_pos|0");
    EXPECT(append_rows(s, 10, 2, -2, 1, DFLASH_DTYPE_F32, ROUND_NONE), S_RANGE, "first_pos|-2");
    EXPECT2(append_rows(s, 10, -3, -1, 1, DFLASH_DTYPE_F32, ROUND_NONE), S_ARG, S_RANGE, "n_rows|-3");
    EXPECT(dflash_drafter_seq_append_context(s, g_rows_f32, (dflash_dtype)9, 0, 1, -1), S_ARG,
           "dtype|9");
    EXPECT2(dflash_drafter_seq_append_context(s, g_rows_f32, DFLASH_DTYPE_F32, 1, 1, -1), S_ARG,
            S_NOTSUP, "device");
    si = seq_info(s);
    CHECK(si.next_position == 10 && si.context_rows == 10);
    CHECK_OK(append_rows(s, 10, 1, 10, 1, DFLASH_DTYPE_F32, ROUND_NONE)); /* explicit == next: ok */

    EXPECT(dflash_drafter_seq_propose(s, VOC, 11, 7, out, BLK, &n), S_RANGE, "64|last_token|token");
    EXPECT(dflash_drafter_seq_propose(s, -1, 11, 7, out, BLK, &n), S_RANGE, "-1|last_token|token");
    EXPECT(dflash_drafter_seq_propose(s, 3, 10, 7, out, BLK, &n), S_RANGE, "position|10");
    EXPECT(dflash_drafter_seq_propose(s, 3, 12, 7, out, BLK, &n), S_RANGE, "position|12");
    EXPECT(dflash_drafter_seq_propose(s, 3, 11, 7, out, 6, &n), S_CAP, "out_tokens|out_capacity");
    EXPECT(dflash_drafter_seq_propose(s, 3, 11, 100, out, 2, &n), S_CAP, "out_tokens|out_capacity");
    EXPECT(dflash_drafter_seq_read_hidden(s, hid, (int64_t)BLK * HS, &rows), S_STATE, NULL);
    EXPECT(dflash_drafter_seq_after_verify(s, 0), S_STATE, NULL);
    si = seq_info(s);
    CHECK(si.proposals == 0 && si.next_position == 11 && si.context_rows == 11);

    CHECK_OK(dflash_drafter_seq_propose(s, 3, 11, 3, out, 3, &n)); /* exactly enough capacity */
    CHECK(n == 3);
    EXPECT(dflash_drafter_seq_read_hidden(s, hid, (int64_t)3 * HS - 1, &rows), S_CAP,
           "out_capacity|95");
    CHECK_OK(dflash_drafter_seq_read_hidden(s, hid, (int64_t)3 * HS, &rows));
    CHECK(rows == 3);
    EXPECT(dflash_drafter_seq_after_verify(s, 4), S_RANGE, "num_accepted|4");
    EXPECT(dflash_drafter_seq_after_verify(s, -1), S_RANGE, "num_accepted|-1");
    si = seq_info(s);
    CHECK(si.accepted_drafts == 0 && si.proposals == 1);
    CHECK_OK(dflash_drafter_seq_after_verify(s, 2)); /* the pending propose survived */
    EXPECT(dflash_drafter_seq_after_verify(s, 0), S_STATE, NULL);
    CHECK_OK(append_rows(s, 11, 3, -1, 1, DFLASH_DTYPE_F32, ROUND_NONE));
    CHECK_OK(dflash_drafter_seq_propose(s, 9, 14, 0, out, BLK, &n));
    CHECK(n == 1);
    CHECK_OK(dflash_drafter_seq_after_verify(s, 1));
    si = seq_info(s);
    CHECK(si.accepted_drafts == 3 && si.proposals == 2);

    /* budget: a sequence of 32 positions */
    if (CHECK_OK(dflash_drafter_seq_alloc(d, 32, &sb))) {
        si = seq_info(sb);
        CHECK(si.budget_tokens == 32);
        /* Positions past the budget are DFLASH_STATUS_CAPACITY ("sequence budget too small" in
         * the status list; the append_context comment says OUT_OF_RANGE: see the report). */
        CHECK_OK(append_rows(sb, 0, 28, 0, 2, DFLASH_DTYPE_F32, ROUND_NONE));
        /* a block must fit the budget: 28 + 8 > 32, 28 + 4 <= 32 */
        EXPECT(dflash_drafter_seq_propose(sb, 1, 28, 7, out, BLK, &n), S_CAP, "budget|32");
        CHECK_OK(dflash_drafter_seq_propose(sb, 1, 28, 3, out, BLK, &n));
        CHECK(n == 3);
        CHECK_OK(dflash_drafter_seq_after_verify(sb, 1));
        CHECK_OK(append_rows(sb, 28, 2, -1, 2, DFLASH_DTYPE_F32, ROUND_NONE));
        EXPECT(append_rows(sb, 30, 5, -1, 2, DFLASH_DTYPE_F32, ROUND_NONE), S_CAP, "budget|32");
        EXPECT(append_rows(sb, 40, 1, 40, 2, DFLASH_DTYPE_F32, ROUND_NONE), S_CAP, "budget|40|32");
        CHECK_OK(append_rows(sb, 30, 2, -1, 2, DFLASH_DTYPE_F32, ROUND_NONE));
        EXPECT(append_rows(sb, 32, 1, -1, 2, DFLASH_DTYPE_F32, ROUND_NONE), S_CAP, "budget|32");
        si = seq_info(sb);
        CHECK(si.next_position == 32 && si.context_rows == 32);
        /* the budget is full: even the narrowest block (anchor at position 32) is past it */
        EXPECT(dflash_drafter_seq_propose(sb, 1, 32, 0, out, BLK, &n), S_CAP, "budget|32");
        CHECK_OK(dflash_drafter_seq_reset(sb));
        CHECK_OK(append_rows(sb, 0, 4, -1, 2, DFLASH_DTYPE_F32, ROUND_NONE));
        CHECK_OK(dflash_drafter_seq_propose(sb, 1, 4, 7, out, BLK, &n));
        CHECK(n == BLK - 1);
        CHECK_OK(dflash_drafter_seq_free(sb));
    }

    /* the first sequence is still fine after all that */
    CHECK_OK(append_rows(s, 14, 2, -1, 1, DFLASH_DTYPE_F32, ROUND_NONE));
    CHECK_OK(dflash_drafter_seq_propose(s, 9, 16, 7, out, BLK, &n));
    CHECK(n == BLK - 1);
    CHECK_OK(dflash_drafter_seq_free(s));
    ps = pool_stats(d);
    CHECK(ps.free_blocks == ps.total_blocks && ps.live_sequences == 0);

done:
    CHECK_OK(dflash_drafter_destroy(d));
    CHECK_OK(dflash_context_destroy(ctx));
}

/* Pool exhaustion: max_batch + 2 sequences each filled to position 120 (8 blocks); the pool
 * (2 * 9 + 1 = 19 blocks) runs out on the third. */
typedef struct {
    dflash_drafter_seq *s;
    int32_t pos, to_append, tok;
    int stage, done;
} filler;

static dflash_status fill_op(filler *f, const char **op)
{
    dflash_status st;
    int32_t out[BLK], n = 0;
    if (f->stage == 0) {
        *op = "append_context";
        st = append_rows(f->s, f->pos, f->to_append, -1, 3, DFLASH_DTYPE_F32, ROUND_NONE);
        if (st == S_OK) {
            f->pos += f->to_append;
            f->stage = 1;
        }
        return st;
    }
    if (f->stage == 1) {
        *op = "propose";
        st = dflash_drafter_seq_propose(f->s, f->tok, f->pos, BLK - 1, out, BLK, &n);
        if (st == S_OK) {
            f->tok = out[0];
            f->stage = 2;
        }
        return st;
    }
    *op = "after_verify";
    st = dflash_drafter_seq_after_verify(f->s, BLK - 1);
    if (st == S_OK) {
        f->to_append = BLK;
        f->stage = 0;
        if (f->pos + BLK + BLK > MAXSEQ) f->done = 1; /* last propose was at 120 */
    }
    return st;
}

static void group_pool_exhaustion(void)
{
    enum { NS = MAXB + 2 };
    dflash_context *ctx = make_host_context();
    dflash_drafter_params p = base_params();
    dflash_drafter *d = NULL;
    filler f[NS];
    int i, j, exhaustions = 0, first_exhausted = -1, guard;
    dflash_pool_stats ps;
    if (!ctx) return;
    d = make_drafter(ctx, &p, UP_NATIVE, 0);
    if (!d) goto done;
    memset(f, 0, sizeof f);
    for (i = 0; i < NS; i++) {
        CHECK_OK(dflash_drafter_seq_alloc(d, 0, &f[i].s)); /* more handles than max_batch: fine */
        f[i].to_append = 16;
        f[i].tok = 1 + i;
    }
    ps = pool_stats(d);
    CHECK(ps.live_sequences == NS && ps.free_blocks == ps.total_blocks);

    for (i = 0; i < NS; i++) {
        if (!f[i].s) continue;
        for (guard = 0; !f[i].done && guard < 200; guard++) {
            const char *op = "";
            dflash_seq_info before = seq_info(f[i].s), after;
            dflash_status st = fill_op(&f[i], &op);
            if (st == S_OK) continue;
            if (!expect_impl(__FILE__, __LINE__, op, st, 1u << S_POOL, "block|pool|KV|kv")) goto cleanup;
            exhaustions++;
            if (first_exhausted < 0) first_exhausted = i;
            after = seq_info(f[i].s);
            CHECK(after.next_position == before.next_position);
            CHECK(after.context_rows == before.context_rows);
            CHECK(after.proposals == before.proposals);
            CHECK(after.accepted_drafts == before.accepted_drafts);
            {
                int32_t held = 0;
                for (j = 0; j < NS; j++)
                    if (f[j].s) held += seq_info(f[j].s).blocks_held;
                ps = pool_stats(d);
                if (!CHECK(ps.free_blocks + held == ps.total_blocks))
                    printf("    free %d + held %d != total %d\n", ps.free_blocks, held, ps.total_blocks);
            }
            /* free the oldest other live sequence and retry the same call */
            for (j = 0; j < NS; j++) {
                if (j != i && f[j].s) {
                    CHECK_OK(dflash_drafter_seq_free(f[j].s));
                    f[j].s = NULL;
                    break;
                }
            }
            if (!expect_impl(__FILE__, __LINE__, op, fill_op(&f[i], &op), 1u, NULL)) goto cleanup;
        }
        CHECK(f[i].done);
    }
    CHECK(exhaustions >= 1);
    if (!CHECK(first_exhausted >= MAXB))
        printf("    the pool ran out on sequence %d; max_batch = %d full sequences must fit\n",
               first_exhausted, MAXB);

cleanup:
    for (i = 0; i < NS; i++)
        if (f[i].s) CHECK_OK(dflash_drafter_seq_free(f[i].s));
    ps = pool_stats(d);
    CHECK(ps.free_blocks == ps.total_blocks);
    CHECK(ps.live_sequences == 0);
    /* and a fresh sequence works */
    {
        filler g;
        const char *op = "";
        memset(&g, 0, sizeof g);
        g.to_append = 16;
        if (CHECK_OK(dflash_drafter_seq_alloc(d, 0, &g.s))) {
            for (guard = 0; !g.done && guard < 200; guard++)
                if (!CHECK_OK(fill_op(&g, &op))) break;
            CHECK_OK(dflash_drafter_seq_free(g.s));
        }
    }
done:
    CHECK_OK(dflash_drafter_destroy(d));
    CHECK_OK(dflash_context_destroy(ctx));
}

static unsigned char g_junk[4096]; /* zero-filled foreign memory posing as a handle */

static void group_handles(void)
{
    dflash_context *ctx = make_host_context(), *ctx2 = NULL;
    dflash_drafter_params p = base_params();
    dflash_drafter *d = NULL, *d2 = NULL;
    dflash_drafter_seq *s = NULL, *s2 = NULL;
    dflash_pool_stats ps;
    dflash_seq_info si;
    int32_t out[BLK], n = 0, rows = 0;
    float hid[BLK * HS];
    const tensor_t *nw = find_tensor("norm.weight");
    if (!ctx) return;

    /* NULL is fine for destroy / free */
    CHECK_OK(dflash_context_destroy(NULL));
    CHECK_OK(dflash_drafter_destroy(NULL));
    CHECK_OK(dflash_drafter_seq_free(NULL));

    /* NULL handles elsewhere */
    memset(&ps, 0, sizeof ps);
    ps.struct_size = sizeof ps;
    memset(&si, 0, sizeof si);
    si.struct_size = sizeof si;
    EXPECT(dflash_context_synchronize(NULL), S_HANDLE, NULL);
    EXPECT(dflash_drafter_set_tensor(NULL, "norm.weight", DFLASH_DTYPE_F32, 1, nw->shape, nw->f32),
           S_HANDLE, NULL);
    EXPECT(dflash_drafter_finalize(NULL), S_HANDLE, NULL);
    EXPECT(dflash_drafter_pool_stats(NULL, &ps), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_alloc(NULL, 0, &s), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_append_context(NULL, g_rows_f32, DFLASH_DTYPE_F32, 0, 1, -1), S_HANDLE,
           NULL);
    EXPECT(dflash_drafter_seq_propose(NULL, 1, 0, 7, out, BLK, &n), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_read_hidden(NULL, hid, (int64_t)BLK * HS, &rows), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_after_verify(NULL, 0), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_info(NULL, &si), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_reset(NULL), S_HANDLE, NULL);

    /* foreign and mistyped handles */
    EXPECT(dflash_context_synchronize((dflash_context *)(void *)g_junk), S_HANDLE, NULL);
    EXPECT(dflash_context_destroy((dflash_context *)(void *)g_junk), S_HANDLE, NULL);
    EXPECT(dflash_drafter_pool_stats((dflash_drafter *)(void *)g_junk, &ps), S_HANDLE, NULL);
    EXPECT(dflash_drafter_destroy((dflash_drafter *)(void *)g_junk), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_info((dflash_drafter_seq *)(void *)g_junk, &si), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_free((dflash_drafter_seq *)(void *)g_junk), S_HANDLE, NULL);
    EXPECT(dflash_drafter_pool_stats((dflash_drafter *)(void *)ctx, &ps), S_HANDLE, NULL);
    EXPECT(dflash_drafter_destroy((dflash_drafter *)(void *)ctx), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_info((dflash_drafter_seq *)(void *)ctx, &si), S_HANDLE, NULL);

    d = make_drafter(ctx, &p, UP_NATIVE, 0);
    if (!d) goto done;
    EXPECT(dflash_context_synchronize((dflash_context *)(void *)d), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_info((dflash_drafter_seq *)(void *)d, &si), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_free((dflash_drafter_seq *)(void *)d), S_HANDLE, NULL);
    EXPECT(dflash_drafter_create((dflash_context *)(void *)d, &p, &d2), S_HANDLE, NULL);
    if (CHECK_OK(dflash_drafter_seq_alloc(d, 0, &s))) {
        EXPECT(dflash_drafter_pool_stats((dflash_drafter *)(void *)s, &ps), S_HANDLE, NULL);
        EXPECT(dflash_drafter_destroy((dflash_drafter *)(void *)s), S_HANDLE, NULL);
        EXPECT(dflash_context_destroy((dflash_context *)(void *)s), S_HANDLE, NULL);
        CHECK_OK(append_rows(s, 0, 20, 0, 1, DFLASH_DTYPE_F32, ROUND_NONE));
        CHECK_OK(dflash_drafter_seq_propose(s, 1, 20, 7, out, BLK, &n));
    }
    CHECK_OK(dflash_drafter_seq_alloc(d, 0, &s2));
    /* the objects survived all the bad calls */
    ps = pool_stats(d);
    CHECK(ps.live_sequences == 2);

    /* destroying the drafter frees its sequences; their handles become invalid */
    CHECK_OK(dflash_drafter_destroy(d));
    EXPECT(dflash_drafter_seq_info(s, &si), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_propose(s, 1, 20, 7, out, BLK, &n), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_after_verify(s, 0), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_reset(s2), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_free(s), S_HANDLE, NULL);
    EXPECT(dflash_drafter_seq_free(s2), S_HANDLE, NULL);
    EXPECT(dflash_drafter_pool_stats(d, &ps), S_HANDLE, NULL);
    EXPECT(dflash_drafter_destroy(d), S_HANDLE, NULL);
    d = NULL;

    /* a drafter keeps its context's backend alive: destroy the context first */
    ctx2 = make_host_context();
    if (ctx2) {
        d2 = make_drafter(ctx2, &p, UP_NATIVE, 0);
        CHECK_OK(dflash_context_destroy(ctx2));
        EXPECT(dflash_context_destroy(ctx2), S_HANDLE, NULL);
        EXPECT(dflash_drafter_create(ctx2, &p, &d), S_HANDLE, NULL);
        if (d2) {
            script_cfg c = default_cfg();
            script_out o;
            script_on(d2, &c, &o);
            CHECK(o.ok);
            CHECK_OK(dflash_drafter_destroy(d2));
        }
    }

done:
    CHECK_OK(dflash_drafter_destroy(d));
    CHECK_OK(dflash_context_destroy(ctx));
}

/* CUDA: only what can be said without knowing the machine. */
static void group_cuda(void)
{
    dflash_context_params cp = dflash_context_default_params();
    dflash_context *ctx = NULL;
    dflash_drafter_params p = base_params();
    dflash_drafter *d = NULL;
    dflash_drafter_seq *s = NULL;
    dflash_status st;
    int32_t count = -1, out[BLK], n = 0, rows = 0;
    float hid[BLK * HS];

    if (!dflash_backend_compiled(DFLASH_BACKEND_CUDA)) {
        EXPECT(dflash_cuda_device_count(&count), S_NOTSUP, NULL);
        printf("    cuda: not compiled in\n");
        return;
    }
    EXPECT(dflash_cuda_device_count(NULL), S_ARG, "out");
    st = dflash_cuda_device_count(&count);
    if (st == S_NODEV) {
        EXPECT(st, S_NODEV, NULL);
        CHECK(count == 0);
    } else if (CHECK_OK(st)) {
        CHECK(count >= 1);
    }
    cp.backend = DFLASH_BACKEND_CUDA;
    st = dflash_context_create(&cp, &ctx);
    if (st != S_OK) {
        /* no usable GPU: a clean refusal with a message (NO_DEVICE when there is no device) */
        if (count == 0) EXPECT(st, S_NODEV, NULL);
        else EXPECT2(st, S_NODEV, S_CUDA, NULL);
        printf("    cuda: context refused (%s)\n", status_name(st));
        return;
    }
    CHECK(count >= 1);
    CHECK_OK(dflash_context_synchronize(ctx));
    cp.device = 4096;
    {
        dflash_context *bad = NULL;
        st = dflash_context_create(&cp, &bad);
        CHECK(st != S_OK);
        /* the header names no status for a missing ordinal: any clean refusal naming it */
        expect_impl(__FILE__, __LINE__, "dflash_context_create(device 4096)", st,
                    (1u << S_ARG) | (1u << S_RANGE) | (1u << S_NODEV) | (1u << S_CUDA), "4096");
        if (st == S_OK) dflash_context_destroy(bad);
    }

#define CUDA_STEP(call)                                                                             \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st == S_NOTSUP) {                                                                      \
            EXPECT(st, S_NOTSUP, NULL);                                                            \
            printf("    cuda: %s -> NOT_SUPPORTED: %s\n", #call, g_msg);                          \
            goto done;                                                                             \
        }                                                                                          \
        if (!CHECK_OK(st)) goto done;                                                              \
    } while (0)

    CUDA_STEP(dflash_drafter_create(ctx, &p, &d));
    {
        int i;
        for (i = 0; i < g_nw; i++) CUDA_STEP(set_one(d, &g_w[i], g_w[i].name, 0));
    }
    CUDA_STEP(dflash_drafter_finalize(d));
    CUDA_STEP(dflash_drafter_seq_alloc(d, 0, &s));
    CUDA_STEP(append_rows(s, 0, 15, 0, 1, DFLASH_DTYPE_F32, ROUND_NONE));
    CUDA_STEP(dflash_drafter_seq_propose(s, 5, 15, 7, out, BLK, &n));
    CHECK(n == BLK - 1);
    {
        int j;
        for (j = 0; j < n; j++) CHECK(out[j] >= 0 && out[j] < VOC);
    }
    CUDA_STEP(dflash_drafter_seq_read_hidden(s, hid, (int64_t)BLK * HS, &rows));
    CHECK(rows == n && all_finite(hid, (size_t)n * HS));
    CUDA_STEP(dflash_drafter_seq_after_verify(s, 3));
    CUDA_STEP(append_rows(s, 15, 4, -1, 1, DFLASH_DTYPE_F32, ROUND_NONE));
    CUDA_STEP(dflash_drafter_seq_propose(s, 5, 19, 7, out, BLK, &n));
    CHECK(n == BLK - 1);
    printf("    cuda: %d device(s), drafter works\n", count);
#undef CUDA_STEP

done:
    if (s) CHECK_OK(dflash_drafter_seq_free(s));
    CHECK_OK(dflash_drafter_destroy(d));
    CHECK_OK(dflash_context_destroy(ctx));
}

/* ------------------------------------------------------------------------------------------ */

static void run_group(const char *name, void (*fn)(void))
{
    int before = g_failures, n;
    if (g_verbose) printf("-- %s\n", name);
    fflush(stdout);
    fn();
    n = g_failures - before;
    if (n) printf("[FAIL] %s: %d failed check(s)\n", name, n);
    else printf("[ ok ] %s\n", name);
    fflush(stdout);
}

int main(void)
{
    const char *v = getenv("DFLASH_TEST_VERBOSE");
    g_verbose = v != NULL && v[0] != '\0' && strcmp(v, "0") != 0;
    build_weights();

    run_group("defaults", group_defaults);
    run_group("versions and status strings", group_versions);
    run_group("bf16/f16 helpers", group_converters);
    run_group("lifecycle (context, drafter, sequence, pool)", group_lifecycle);
    run_group("determinism", group_determinism);
    run_group("variants (tied, ctx_window ring, sliding, rope, scales)", group_variants);
    run_group("NULL pointers and struct_size", group_struct_size_and_null);
    run_group("bad drafter params", group_bad_params);
    run_group("tensor errors", group_tensors);
    run_group("sequence errors", group_sequence_errors);
    run_group("pool exhaustion", group_pool_exhaustion);
    run_group("handles", group_handles);
    run_group("cuda backend", group_cuda);

    free_weights();
    if (g_failures == 0) {
        printf("ALL OK\n");
        return 0;
    }
    printf("FAILED: %d check(s)\n", g_failures);
    return g_failures > 100 ? 100 : g_failures;
}
