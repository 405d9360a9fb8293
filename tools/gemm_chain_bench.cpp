// gemm_chain_bench.cpp: the library's own GEMMs as a decode or verify step runs them, with nothing between
// them: per layer q/k/v (folded norm), o_proj (+ residual, sums of squares), gate/up + SwiGLU (folded norm),
// down (+ residual, sums of squares), over L layers of Qwen3-8B-shaped tiled weights, through the cuda
// backend (programmatic dependent launch as in the library). The counterpart of tools/phase_bench.cu, which
// streams the same bytes through a GEMM-shaped probe: the difference is what the real kernels add per launch
// (epilogues, k-split reduces, tilings), and bench.py's decode row minus this is what attention and the rest
// of the step add.
//
// Built with the op tests (-DDFLASH_OP_TESTS=ON; gpu_check.sh builds it as build/gpu/gemm_chain_bench):
//   build/gpu/gemm_chain_bench [--rows 1] [--layers 36] [--iters 30] [--only qkv|o_proj|gate_up|down] [--ctx N]
//                              [--hidden 4096] [--inter 12288]
//                              [--sweep] [--noncausal] [--probe [--probe-gemm qkv|o_proj|gate_up|down[,...]]]
//   build/local/gemm_chain_bench --host --layers 1 --iters 1 --ctx 64    # the tool's own check, on the CPU
// --hidden / --inter: other layer shapes (--hidden 2560 --inter 9728: Qwen3-4B-DFlash-b16's layers; q and
// k/v keep 32 and 8 heads of 128). --only repeats one GEMM of each layer (36 back to back): its cost alone. --ctx N adds each layer's attention
// phase as Target::forward runs it (q/k norm + RoPE + cache write, attention over N + rows keys in a sequence of
// capacity N + 64, the combine) between q/k/v and o_proj: with and without it, the attention phase's cost in a
// step; --sweep (with --ctx) times the chain without the phase, with only its rope kernel, with only attention
// and the combine, and whole, in one process (what each kernel adds per layer). The library's switches apply
// (DFLASH_PDL=0, DFLASH_FUSED_NORM=0, DFLASH_GEMM_PERSIST=0, ...: one process per setting). --noncausal: the
// drafter's mask (a propose's block sees every key). --probe (with --ctx; a build with -DDFLASH_PHASE_PROBE=ON):
// after the timing, one more step; the last layer's rope, attention, combine and o_proj blocks' %globaltimer
// stamps (--probe-gemm qkv|gate_up|down: that GEMM's instead of o_proj's; a comma list: one more step each), and
// the norm kernel's last launch (the norm before the last gate/up, where a norm kernel runs: DFLASH_GEMM_FOLD_NORM
// without 2), printed as min / p10 / median / p90 / max over blocks in us after the q/k/v GEMM ended (the rope
// kernel's wait returned).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "backend.hpp"
#include "common.hpp"

using namespace dflash;

#ifdef DFLASH_PHASE_PROBE
namespace dflash::cuda {  // rope.cu, attention.cu (probe builds only)
int probe_table_rope(std::vector<unsigned long long> *out);  // the stamps per table row
int probe_table_norm(std::vector<unsigned long long> *out);  // norm.cu: the norm kernel's last launch
int probe_table_attention(int which, std::vector<unsigned long long> *out);
// The GEMM families' tables (gemv_<family>.cu, DFLASH_GEMM_PROBE_ACCESSORS): the launches of one shape.
int probe_table_gemm_store(std::vector<unsigned long long> *out);
int probe_table_gemm_store_norm(std::vector<unsigned long long> *out);
int probe_table_gemm_store_stats(std::vector<unsigned long long> *out);
int probe_table_gemm_swiglu(std::vector<unsigned long long> *out);
void probe_gemm_select_store(int64_t n, int64_t k);
void probe_gemm_select_store_norm(int64_t n, int64_t k);
void probe_gemm_select_store_stats(int64_t n, int64_t k);
void probe_gemm_select_swiglu(int64_t n, int64_t k);
}  // namespace dflash::cuda
#endif

namespace {

#define CHECK_CUDA(x)                                                                       \
    do {                                                                                    \
        cudaError_t e_ = (x);                                                               \
        if (e_ != cudaSuccess) {                                                            \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            std::exit(1);                                                                   \
        }                                                                                   \
    } while (0)

// Random bf16 bits of magnitude about 2^-7 .. 2^-5 and either sign (never zeros: METHOD.md).
void fill_random(std::vector<uint16_t> &v, uint64_t seed) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (auto &x : v) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x = uint16_t(((s >> 20) & 0x8000u) | ((0x78u + (s & 1u)) << 7) | ((s >> 8) & 0x7Fu));
    }
}

struct Matrix {
    void *data = nullptr;
    WeightView view;
};

#ifdef DFLASH_PHASE_PROBE
// One more step with the probe tables zeroed; each table keeps its last launch's blocks (the last layer's).
// The GEMM rows: the last launch of shape (gemm_n, gemm_k) (--probe-gemm; o_proj's by default), from the first
// family whose table it stamped (a shape is launched by one family in a chain).
void print_probe(const std::shared_ptr<Backend> &b, const std::function<void()> &step, const char *gemm_name,
                 int64_t gemm_n, int64_t gemm_k) {
    using Table = std::vector<unsigned long long>;
    using TableIo = int (*)(Table *);
    using Select = void (*)(int64_t, int64_t);
    const struct {
        const char *family;
        TableIo io;
        Select select;
    } families[] = {{"store", cuda::probe_table_gemm_store, cuda::probe_gemm_select_store},
                    {"store_norm", cuda::probe_table_gemm_store_norm, cuda::probe_gemm_select_store_norm},
                    {"store_stats", cuda::probe_table_gemm_store_stats, cuda::probe_gemm_select_store_stats},
                    {"swiglu", cuda::probe_table_gemm_swiglu, cuda::probe_gemm_select_swiglu}};
    for (const auto &f : families) {
        f.select(gemm_n, gemm_k);
        f.io(nullptr);
    }
    cuda::probe_table_rope(nullptr);
    cuda::probe_table_norm(nullptr);
    cuda::probe_table_attention(0, nullptr);
    cuda::probe_table_attention(1, nullptr);
    b->synchronize();
    step();
    b->synchronize();
    Table rope, attn, comb, norm, gemm;
    const size_t stamps = size_t(cuda::probe_table_rope(&rope));  // the tables share one layout
    cuda::probe_table_norm(&norm);
    cuda::probe_table_attention(0, &attn);
    cuda::probe_table_attention(1, &comb);
    const char *gemm_family = "none";
    for (const auto &f : families) {
        Table t;
        f.io(&t);
        if (std::any_of(t.begin(), t.end(), [](unsigned long long x) { return x != 0; })) {
            gemm = std::move(t);
            gemm_family = f.family;
            break;
        }
    }
    auto column = [&](const Table &t, int point) {
        std::vector<unsigned long long> v;
        for (size_t i = point; i < t.size(); i += stamps)
            if (t[i]) v.push_back(t[i]);
        std::sort(v.begin(), v.end());
        return v;
    };
    const auto ref_col = column(rope, 1);
    if (ref_col.empty()) {
        std::printf("probe: the rope kernel stamped nothing\n");
        return;
    }
    const double ref = double(ref_col.front());
    struct Point { const char *kernel; const Table *t; int point; const char *what; };
    const Point points[] = {
        {"rope", &rope, 0, "entry (before its wait)"}, {"rope", &rope, 1, "wait returned (q/k/v done)"},
        {"attention", &attn, 0, "entry"}, {"attention", &attn, 5, "returned: no keys"},
        {"attention", &attn, 1, "wait returned"}, {"attention", &attn, 2, "chunk 0 and Q landed"},
        {"attention", &attn, 6, "chunk 1 staging issued"}, {"attention", &attn, 7, "chunk 0: Q K^T issued"},
        {"attention", &attn, 8, "chunk 0: maxima shared"}, {"attention", &attn, 9, "chunk 0: P shared"},
        {"attention", &attn, 3, "k loop done"}, {"attention", &attn, 4, "end (partials stored)"},
        {"combine", &comb, 0, "entry"}, {"combine", &comb, 1, "wait returned"},
        {"combine", &comb, 2, "split records in"}, {"combine", &comb, 3, "end"},
        {"norm", &norm, 0, "entry"}, {"norm", &norm, 1, "wait returned"},
        {"norm", &norm, 2, "row's squares summed"}, {"norm", &norm, 3, "end"},
        {gemm_name, &gemm, 0, "entry"}, {gemm_name, &gemm, 1, "ring's first chunks issued"},
        {gemm_name, &gemm, 2, "wait returned"}, {gemm_name, &gemm, 3, "k loop done"}, {gemm_name, &gemm, 4, "end"}};
    std::printf("probe (us after the first rope block's wait returned; min / p10 / median / p90 / max over blocks, "
                "blocks; %s: the %s family's launch)\n", gemm_name, gemm_family);
    for (const Point &p : points) {
        const auto v = column(*p.t, p.point);
        if (v.empty()) continue;
        auto us = [&](unsigned long long x) { return (double(x) - ref) * 1e-3; };
        std::printf("  %-10s %-28s %8.2f %8.2f %8.2f %8.2f %8.2f  (%zu)\n", p.kernel, p.what, us(v.front()),
                    us(v[v.size() / 10]), us(v[v.size() / 2]), us(v[v.size() * 9 / 10]), us(v.back()), v.size());
    }
}
#endif

}  // namespace

int main(int argc, char **argv) {
    int64_t rows = 1, layers = 36, iters = 30, ctx = 0, hidden = 4096, inter = 12288;
    bool host = false, sweep = false, causal = true, probe = false;
    std::string only, probe_gemm = "o_proj";
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&]() -> const char * {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "%s needs a value\n", a.c_str());
                std::exit(2);
            }
            return argv[++i];
        };
        if (a == "--rows") rows = std::atoll(next());
        else if (a == "--layers") layers = std::atoll(next());
        else if (a == "--iters") iters = std::atoll(next());
        else if (a == "--only") only = next();
        else if (a == "--ctx") ctx = std::atoll(next());
        else if (a == "--hidden") hidden = std::atoll(next());
        else if (a == "--inter") inter = std::atoll(next());
        else if (a == "--host") host = true;
        else if (a == "--sweep") sweep = true;
        else if (a == "--noncausal") causal = false;
        else if (a == "--probe") probe = true;
        else if (a == "--probe-gemm") probe_gemm = next();
        else {
            std::fprintf(stderr, "usage: gemm_chain_bench [--rows M] [--layers L] [--iters N] [--only qkv|o_proj|gate_up|down] "
                                 "[--ctx N] [--hidden H] [--inter I] [--sweep] [--noncausal] [--probe [--probe-gemm qkv|o_proj|gate_up|down[,...]]]\n");
            return 2;
        }
    }
    if (rows < 1 || rows > 16 || layers < 1 || iters < 1 || ctx < 0 || ctx > (1 << 20) || hidden < 64 ||
        hidden > 65536 || hidden % 64 || inter < 64 || inter > 65536 || inter % 64) {
        std::fprintf(stderr, "gemm_chain_bench: rows 1..16, layers and iters >= 1, ctx 0..2^20, hidden and inter "
                             "multiples of 64 in 64..65536\n");
        return 2;
    }
    auto known = [](const std::string &name) {
        return name == "qkv" || name == "o_proj" || name == "gate_up" || name == "down";
    };
    if (!only.empty() && !known(only)) {
        std::fprintf(stderr, "gemm_chain_bench: --only %s (qkv, o_proj, gate_up or down)\n", only.c_str());
        return 2;
    }
    std::vector<std::string> probe_gemms;  // --probe-gemm a,b: one probed step per name, in order
    for (size_t at = 0; at <= probe_gemm.size();) {
        const size_t comma = std::min(probe_gemm.find(',', at), probe_gemm.size());
        probe_gemms.push_back(probe_gemm.substr(at, comma - at));
        at = comma + 1;
    }
    for (const std::string &name : probe_gemms)
        if (!known(name)) {
            std::fprintf(stderr, "gemm_chain_bench: --probe-gemm %s (qkv, o_proj, gate_up or down, or a comma list)\n",
                         probe_gemm.c_str());
            return 2;
        }
    cudaStream_t stream = nullptr;
    std::shared_ptr<Backend> b;
    int devices = 0;
    if (host) {
        b = make_host_backend();  // a check of the tool itself: the same ops on the CPU, timed by the clock
    } else if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        std::printf("SKIP: no CUDA device\n");
        return 77;
    } else try {
        CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        b = make_cuda_backend(0, uint64_t(reinterpret_cast<uintptr_t>(stream)), false);
    } catch (const Error &e) {
        std::printf("SKIP: no usable CUDA device: %s\n", e.what());
        return 77;
    }
    const int64_t H = hidden, I = inter, Q = 4096, KV = 1024, QKV = Q + 2 * KV;
    const float eps = 1e-6f;
    const bool tiled = b->tiles_gemm_weights(), folded = b->folds_norms();

    // One layer's matrices as random row-major bf16 on the host, uploaded (and tiled) into every layer's own
    // device memory: the same values, never the same bytes, so nothing is served from L2 across layers.
    struct Shape {
        const char *name;
        int64_t n, k;
    };
    const Shape shapes[4] = {{"qkv", QKV, H}, {"o_proj", H, Q}, {"gate_up", 2 * I, H}, {"down", H, I}};
    std::vector<std::vector<Matrix>> w(size_t(layers), std::vector<Matrix>(4));
    try {
        for (int m = 0; m < 4; ++m) {
            const Shape &sh = shapes[m];
            std::vector<uint16_t> host(size_t(sh.n * sh.k));
            fill_random(host, uint64_t(m + 1));
            void *src = b->alloc(host.size() * 2);
            b->upload(src, host.data(), host.size() * 2);
            WeightView row_major{src, DFLASH_DTYPE_BF16, sh.n, sh.k, false};
            for (int64_t l = 0; l < layers; ++l) {
                Matrix &mx = w[size_t(l)][size_t(m)];
                const size_t bytes = size_t(tiled ? tiled_elements(sh.n, sh.k) : sh.n * sh.k) * 2;
                mx.data = b->alloc(bytes);
                if (tiled)
                    b->tile_gemm_weight(row_major, mx.data);
                else
                    b->copy(mx.data, src, bytes);
                mx.view = WeightView{mx.data, DFLASH_DTYPE_BF16, sh.n, sh.k, tiled};
            }
            b->synchronize();
            b->release(src);
        }
    } catch (const Error &e) {
        std::printf("FAIL: allocating %lld layers of weights: %s\n", (long long)layers, e.what());
        return 1;
    }
    // Activations: x (the residual stream), the q/k/v rows, attention's output, gate/up scratch, the MLP
    // rows, and the rows' sums of squares between GEMMs (ones to start: the first q/k/v reads them).
    // (act dtype: bf16 on cuda, fp32 on the host)
    const size_t act_bytes = dtype_size(b->act_dtype());
    auto act = [&](int64_t cols) {
        const size_t n = size_t(16 * cols);
        void *p = b->alloc(n * act_bytes);
        std::vector<uint16_t> v(n);
        fill_random(v, uint64_t(cols));
        if (act_bytes == 2) {
            b->upload(p, v.data(), n * 2);
        } else {
            std::vector<float> f(n);
            for (size_t i = 0; i < n; ++i) {
                const uint32_t bits = uint32_t(v[i]) << 16;
                std::memcpy(&f[i], &bits, 4);
            }
            b->upload(p, f.data(), n * 4);
        }
        return p;
    };
    void *x = act(H), *qkv = act(QKV), *attn = act(Q), *gu = act(2 * I), *mlp = act(I);
    const int64_t parts = ss_parts(H);
    float *ss = static_cast<float *>(b->alloc(size_t(16 * parts) * sizeof(float)));
    {
        std::vector<float> ones(size_t(16 * parts), 1.f);
        b->upload(ss, ones.data(), ones.size() * sizeof(float));
    }
    // --ctx: each layer's K/V cache of capacity ctx + 64 (an identity block table: slot s is position s), the
    // step's positions ctx .. ctx + rows - 1 and its key count, q/k norm weights and the RoPE table.
    const int64_t hd = 128, nh = Q / hd, nkv = KV / hd, capacity = (ctx + 64 + 15) / 16 * 16;
    std::vector<void *> k_cache, v_cache;
    int32_t *table = nullptr, *key_pos = nullptr, *step_args = nullptr;
    void *qk_norm = nullptr;
    float *inv_freq = nullptr;
    PagedKeys keys;
    if (ctx > 0) {
        for (int64_t l = 0; l < layers; ++l) {
            k_cache.push_back(act(capacity * KV / 16));
            v_cache.push_back(act(capacity * KV / 16));
        }
        std::vector<int32_t> ids(static_cast<size_t>(capacity)), args(static_cast<size_t>(2 * rows + 1));
        for (int64_t i = 0; i < capacity; ++i) ids[size_t(i)] = int32_t(i);
        for (int64_t j = 0; j < rows; ++j) args[size_t(j)] = args[size_t(rows + j)] = int32_t(ctx + j);
        args[size_t(2 * rows)] = int32_t(ctx + rows);
        table = static_cast<int32_t *>(b->alloc(size_t(capacity / 16) * 4));
        key_pos = static_cast<int32_t *>(b->alloc(size_t(capacity) * 4));
        step_args = static_cast<int32_t *>(b->alloc(args.size() * 4));
        b->upload(table, ids.data(), size_t(capacity / 16) * 4);
        b->upload(key_pos, ids.data(), size_t(capacity) * 4);
        b->upload(step_args, args.data(), args.size() * 4);
        std::vector<uint16_t> ones(size_t(hd), 0x3f80);  // bf16 1.0
        qk_norm = b->alloc(size_t(hd) * 2);
        b->upload(qk_norm, ones.data(), ones.size() * 2);
        std::vector<float> freq(size_t(hd / 2));
        for (int64_t i = 0; i < hd / 2; ++i) freq[size_t(i)] = std::pow(1e6f, -2.f * float(i) / float(hd));
        inv_freq = static_cast<float *>(b->alloc(freq.size() * sizeof(float)));
        b->upload(inv_freq, freq.data(), freq.size() * sizeof(float));
        keys.block_table = table;
        keys.slot_positions = key_pos;
        keys.ring_slots = capacity;
        keys.first_key = 0;
        keys.num_keys = ctx + rows;
        keys.num_keys_device = step_args + 2 * rows;
        keys.uniform_rows = 16;  // the target's max_verify_rows at block 16
        keys.fresh_keys = rows;  // as Target::forward: the keys before the step's rows are settled
    }
    const WeightView norm_w{qk_norm, DFLASH_DTYPE_BF16, 1, hd, false};
    bool do_rope = true, do_attn = true;  // --sweep: the attention phase's kernels one by one
    auto attention_phase = [&](int64_t l) {
        if (do_rope) b->qkv_norm_rope_write(qkv, QKV, static_cast<char *>(qkv) + size_t(Q) * act_bytes, QKV, rows, nh, nkv, hd, &norm_w, &norm_w, eps,
                               step_args, inv_freq, 1.f, step_args + rows, k_cache[size_t(l)], v_cache[size_t(l)]);
        keys.k_cache = k_cache[size_t(l)];
        keys.v_cache = v_cache[size_t(l)];
        if (do_attn) b->attention(qkv, QKV, rows, step_args, nh, nkv, hd, 1.f / std::sqrt(float(hd)), AttentionMask{causal, 0}, keys,
                     attn);
    };
    // As the target runs them: the sums of squares only where the norming op reads them (reads_norm_stats; an op
    // that does not takes the norm kernel before a plain GEMM).
    float *ss_qkv = folded && b->reads_norm_stats(Backend::NormOp::Gemm) ? ss : nullptr;
    float *ss_mlp = folded && b->reads_norm_stats(Backend::NormOp::SwiGLU) ? ss : nullptr;
    const GemmFuse norm_qkv{folded ? eps : 0.f, false, ss_qkv, nullptr}, norm_mlp{folded ? eps : 0.f, false, ss_mlp, nullptr};
    const GemmFuse to_mlp{0.f, folded, nullptr, ss_mlp}, to_qkv{0.f, folded, nullptr, ss_qkv};
    const bool all = only.empty();
    size_t step_bytes = 0;
    auto step = [&] {
        for (int64_t l = 0; l < layers; ++l) {
            const auto &lw = w[size_t(l)];
            if (all || only == "qkv") b->gemm(x, rows, H, lw[0].view, qkv, QKV, GemmRows::Uniform, norm_qkv);
            if (ctx > 0) attention_phase(l);
            if (all || only == "o_proj") b->gemm(attn, rows, Q, lw[1].view, x, H, GemmRows::Uniform, to_mlp);
            if (all || only == "gate_up")
                b->gemm_swiglu(x, rows, H, lw[2].view, I, gu, mlp, GemmRows::Uniform, norm_mlp);
            if (all || only == "down") b->gemm(mlp, rows, I, lw[3].view, x, H, GemmRows::Uniform, to_qkv);
        }
    };
    for (int m = 0; m < 4; ++m)
        if (all || only == shapes[m].name) step_bytes += size_t(layers * shapes[m].n * shapes[m].k) * 2;

    cudaEvent_t e0 = nullptr, e1 = nullptr;
    if (!host) {
        CHECK_CUDA(cudaEventCreate(&e0));
        CHECK_CUDA(cudaEventCreate(&e1));
    }
    auto median_ms = [&](const std::function<void()> &f, int64_t n) {
        for (int i = 0; i < (host ? 1 : 3); ++i) f();
        b->synchronize();
        std::vector<float> t;
        for (int64_t i = 0; i < n; ++i) {
            float ms = 0.f;
            if (host) {
                const auto t0 = std::chrono::steady_clock::now();
                f();
                ms = std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - t0).count();
            } else {
                CHECK_CUDA(cudaEventRecord(e0, stream));
                f();
                CHECK_CUDA(cudaEventRecord(e1, stream));
                CHECK_CUDA(cudaEventSynchronize(e1));
                CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
            }
            t.push_back(ms);
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2];
    };
    float copy_ms = 0.f;
    const size_t copy_bytes = host ? size_t(64) << 20 : size_t(2) << 30;
    {
        void *a = b->alloc(copy_bytes), *c = b->alloc(copy_bytes);
        copy_ms = median_ms([&] { b->copy(c, a, copy_bytes); }, 10);
        b->release(a);
        b->release(c);
    }
    const double copy_bw = 2.0 * double(copy_bytes) / (copy_ms * 1e-3);
    float ms = 0.f;
    if (sweep && ctx > 0) {  // the chain without the phase, with its rope kernel only, with attention only, whole
        struct Part { const char *name; bool rope, attn; int64_t ctx; };
        const Part parts[] = {{"the GEMMs only", false, false, 0}, {"+ q/k norm, RoPE, cache write", true, false, ctx},
                              {"+ attention and combine (no rope kernel)", false, true, ctx},
                              {"+ the whole attention phase", true, true, ctx}};
        const int64_t ctx0 = ctx;
        float base = 0.f;
        for (const Part &pt : parts) {
            do_rope = pt.rope, do_attn = pt.attn, ctx = pt.ctx;
            const float t = median_ms(step, iters);
            if (pt.ctx == 0) base = t;
            std::printf("sweep rows %lld ctx %lld: %-42s %.3f ms (%+.2f us per layer)\n", (long long)rows,
                        (long long)ctx0, pt.name, t, (t - base) * 1e3 / double(layers));
        }
        ctx = ctx0;
        do_rope = do_attn = true;
    }
    try {
        ms = median_ms(step, iters);
    } catch (const Error &e) {
        std::printf("FAIL: %s\n", e.what());
        return 1;
    }
    if (probe && (ctx == 0 || host)) {
        std::printf("--probe: needs --ctx N and the cuda backend (it stamps the attention phase's kernels)\n");
    } else if (probe) {
#ifdef DFLASH_PHASE_PROBE
        for (const std::string &name : probe_gemms)
            for (const Shape &sh : shapes)
                if (name == sh.name) print_probe(b, step, sh.name, sh.n, sh.k);
#else
        std::printf("--probe: this build has no probe (cmake -DDFLASH_PHASE_PROBE=ON)\n");
#endif
    }
    const int64_t launches = layers * (all ? 4 : 1);
    const double floor_ms = double(step_bytes) / copy_bw * 1e3;
    std::printf("gemm_chain_bench: rows %lld, layers %lld (H %lld, I %lld), %s%s, tiled %d, folded %d: %lld GEMMs, "
                "%.2f GB of weights\n",
                (long long)rows, (long long)layers, (long long)H, (long long)I, all ? "all four GEMMs" : only.c_str(),
                ctx > 0 ? cat(", attention over ", ctx + rows, " keys").c_str() : "", int(tiled), int(folded),
                (long long)launches, double(step_bytes) / 1e9);
    std::printf("copy bandwidth %.3f TB/s; chain %.3f ms = %.3f TB/s = %.3fx the floor (%.3f ms); %.2f us per GEMM "
                "over the floor\n",
                copy_bw / 1e12, ms, double(step_bytes) / (ms * 1e-3) / 1e12, ms / floor_ms, floor_ms,
                (ms - floor_ms) * 1e3 / double(launches));
    for (auto &lw : w)
        for (auto &m : lw) b->release(m.data);
    for (void *p : {x, qkv, attn, gu, mlp}) b->release(p);
    for (size_t l = 0; l < k_cache.size(); ++l) b->release(k_cache[l]), b->release(v_cache[l]);
    for (void *p : {static_cast<void *>(table), static_cast<void *>(key_pos), static_cast<void *>(step_args), qk_norm,
                    static_cast<void *>(inv_freq)})
        b->release(p);
    b->release(ss);
    b.reset();
    if (stream) CHECK_CUDA(cudaStreamDestroy(stream));
    return 0;
}
