// test_ops.cpp: every op of the cuda backend against the host backend, on random inputs.
//
// In the spirit of llama.cpp's test-backend-ops and FlashInfer's kernel tests: both backends run
// each op on the same random inputs (awkward sizes, strided rows, a partly full last KV block, a
// wrapped ring), and the cuda result must match the host's within the tolerance of its dtype
// (DESIGN §6). The inputs are chosen bf16-exact, so the host gets them in fp32 and the cuda
// backend the very same numbers in bf16: the comparison measures kernel error, not input
// rounding. Outputs are poisoned (0xFF bytes: NaN in bf16 and fp32, -1 in int32) before every
// run, so an element the kernel forgot to write fails the NaN check, and the padding between
// strided rows must still hold the poison afterwards.
//
// Compiled against the library's internal sources (not the C ABI): it needs the Backend
// interface itself. One line per op group, "ALL OK" at the end, exit code = failed cases
// (capped at 255). Exit code 77 (the automake "skip" code): no CUDA device.
//
//   test_ops [--seed N] [--smoke | --quick | --full] [--filter a,b] [--verbose]
//            [--self-test [--inject-fault OP]]
//
// --smoke: a few small cases per op (seconds); --quick: small and medium sizes (meant for
// compute-sanitizer); default: every size listed in the issue; --full: the whole attention
// product (nq x GQA x head_dim x keys x mask x wrap). A failure prints the case, its seed, and
// the command that reruns it. --self-test checks the harness itself on a machine without a GPU
// (see EmulatedBf16Backend). The seed also comes from $DFLASH_TEST_SEED.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend.hpp"
#include "common.hpp"
#include "philox.hpp"

// From native/src/cuda/ops.cuh (a CUDA header): whether a GemmRows::Wide call takes the wide GEMM, so
// the gemm_wide cases know they ran it.
namespace dflash {
namespace cuda {
bool gemm_wide_fits(const __nv_bfloat16 *x, int64_t M, int64_t ldx, const __nv_bfloat16 *w, bool w_tiled,
                    int64_t K);
}  // namespace cuda
}  // namespace dflash

namespace {

using namespace dflash;

// ----------------------------------------------------------------------------------------------
// Options, tolerances
// ----------------------------------------------------------------------------------------------

enum Level { SMOKE = 0, QUICK = 1, DEFAULT = 2, FULL = 3 };

struct Options {
    uint64_t seed = 0;
    Level level = DEFAULT;
    std::vector<std::string> filters;
    bool verbose = false;
    bool self_test = false;   // C = a bf16 emulation on the CPU (checks the harness, no GPU)
    std::string fault;        // --inject-fault OP: the emulation gets one element of OP wrong
};

Options g_opt;

// The two backends under comparison.
Backend *H = nullptr;  // host: the reference
Backend *C = nullptr;  // cuda (or its --self-test emulation): under test

// ‖got − ref‖ / ‖ref‖ bounds, keyed by the dtype of the cuda result (DESIGN §6). Every element
// must also satisfy |got − ref| <= kElemFactor * tol * (|ref| + rms(ref)), so a single wrong
// element in a large output cannot hide inside the norm.
constexpr double kTolBf16 = 2e-2;       // bf16 result vs fp32 host
constexpr double kTolF32FromBf16 = 5e-3;// fp32 result (logits) from bf16 operands, fp32 accumulation
constexpr double kTolF32 = 1e-4;        // fp32 in, fp32 out (sampling probabilities)
constexpr double kElemFactor = 5.0;

// ----------------------------------------------------------------------------------------------
// Random numbers and bf16
// ----------------------------------------------------------------------------------------------

uint16_t bf16_bits_rne(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t(bits >> 16);
}

float round_bf16(float f) { return bf16_to_float(bf16_bits_rne(f)); }

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser: case seeds from (run seed, group, index)
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

uint64_t hash_str(const std::string &s) {
    uint64_t h = 1469598103934665603ull;
    for (char c : s) h = (h ^ uint8_t(c)) * 1099511628211ull;
    return h;
}

struct Rng {
    std::mt19937_64 gen;
    explicit Rng(uint64_t seed) : gen(seed) {}

    float normal(float sd = 1.f) { return std::normal_distribution<float>(0.f, sd)(gen); }
    float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen); }
    int64_t index(int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(gen); }
    uint64_t bits() { return gen(); }

    // n normal values, each exactly representable in bf16. Bulk data (weights of up to ~1e8
    // elements) comes from Box-Muller over a splitmix64 stream: ~10x faster than
    // std::normal_distribution, and the statistics do not matter here.
    std::vector<float> bf16_normal(size_t n, float sd = 1.f) {
        std::vector<float> v(n);
        uint64_t state = gen();
        const float two_pi = 6.28318530718f;
        for (size_t i = 0; i < n; i += 2) {
            const uint64_t bits = mix64(state += 0x9E3779B97F4A7C15ull);
            const float u1 = (float(uint32_t(bits) >> 8) + 1.f) * (1.f / 16777216.f);  // (0, 1]
            const float u2 = float(uint32_t(bits >> 32) >> 8) * (1.f / 16777216.f);
            const float r = sd * std::sqrt(-2.f * std::log(u1));
            v[i] = round_bf16(r * std::cos(two_pi * u2));
            if (i + 1 < n) v[i + 1] = round_bf16(r * std::sin(two_pi * u2));
        }
        return v;
    }
};

// ----------------------------------------------------------------------------------------------
// Backend memory helpers (all data movement through Backend::upload / download)
// ----------------------------------------------------------------------------------------------

bool is_cuda(const Backend &b) { return b.kind() == DFLASH_BACKEND_CUDA; }

size_t act_size(const Backend &b) { return dtype_size(b.act_dtype()); }

std::vector<uint8_t> encode(dflash_dtype dtype, const std::vector<float> &v) {
    std::vector<uint8_t> raw(v.size() * dtype_size(dtype));
    if (dtype == DFLASH_DTYPE_F32) {
        std::memcpy(raw.data(), v.data(), raw.size());
    } else if (dtype == DFLASH_DTYPE_BF16) {
        for (size_t i = 0; i < v.size(); ++i) {
            const uint16_t h = bf16_bits_rne(v[i]);
            std::memcpy(raw.data() + 2 * i, &h, 2);
        }
    } else {
        fail(DFLASH_STATUS_INTERNAL, "test: cannot encode ", dtype_name(dtype));
    }
    return raw;
}

DeviceBuffer upload_bytes(Backend &b, const void *data, size_t bytes) {
    DeviceBuffer buf(&b, bytes);
    b.upload(buf.get(), data, bytes);
    return buf;
}

template <typename T>
DeviceBuffer upload_vec(Backend &b, const std::vector<T> &v) {
    return upload_bytes(b, v.data(), v.size() * sizeof(T));
}

// Activations: fp32 values -> the backend's activation dtype.
DeviceBuffer upload_act(Backend &b, const std::vector<float> &v) {
    const std::vector<uint8_t> raw = encode(b.act_dtype(), v);
    return upload_bytes(b, raw.data(), raw.size());
}

DeviceBuffer poisoned(Backend &b, size_t bytes) {
    const std::vector<uint8_t> ff(bytes, 0xFF);
    return upload_bytes(b, ff.data(), bytes);
}

std::vector<uint8_t> download_bytes(Backend &b, const void *p, size_t bytes) {
    std::vector<uint8_t> raw(bytes);
    b.download(raw.data(), p, bytes);
    return raw;
}

template <typename T>
std::vector<T> download_vec(Backend &b, const void *p, size_t n) {
    std::vector<T> v(n);
    b.download(v.data(), p, n * sizeof(T));
    return v;
}

std::vector<float> decode(dflash_dtype dtype, const std::vector<uint8_t> &raw) {
    std::vector<float> v(raw.size() / dtype_size(dtype));
    for (size_t i = 0; i < v.size(); ++i) v[i] = load_as_float(raw.data(), dtype, int64_t(i));
    return v;
}

std::vector<float> download_act(Backend &b, const void *p, size_t n) {
    return decode(b.act_dtype(), download_bytes(b, p, n * act_size(b)));
}

// True if element i of a buffer of elements of `elem` bytes still holds the 0xFF poison.
bool still_poisoned(const std::vector<uint8_t> &raw, size_t elem, size_t i) {
    for (size_t k = 0; k < elem; ++k)
        if (raw[i * elem + k] != 0xFF) return false;
    return true;
}

// A weight matrix in the dtype this backend stores weights in (host: fp32; cuda: bf16, as its
// WeightStore converts them on upload); the values are bf16-exact, so both hold the same numbers.
struct Weight {
    DeviceBuffer buf;
    WeightView view;
};

Weight upload_weight(Backend &b, const std::vector<float> &w, int64_t rows, int64_t cols) {
    Weight out;
    const dflash_dtype dtype = b.weight_dtype(DFLASH_DTYPE_F32);
    const std::vector<uint8_t> raw = encode(dtype, w);
    out.buf = upload_bytes(b, raw.data(), raw.size());
    out.view.data = out.buf.get();
    out.view.dtype = dtype;
    out.view.rows = rows;
    out.view.cols = cols;
    return out;
}

// The same weight in the tiled GEMM layout (backend.hpp), made by the backend's own tiling
// kernel, as WeightStore does when the backend asks for it (cuda unless DFLASH_GEMM_TILED=0).
Weight tiled_weight(Backend &b, const Weight &w) {
    Weight out;
    out.buf = DeviceBuffer(&b, size_t(tiled_elements(w.view.rows, w.view.cols)) * dtype_size(w.view.dtype));
    b.tile_gemm_weight(w.view, out.buf.get());
    out.view = w.view;
    out.view.data = out.buf.get();
    out.view.tiled = true;
    return out;
}

// After every cuda op: wait, and surface launch errors that the op itself did not report.
void sync(Backend &b) {
    b.synchronize();
    if (is_cuda(b)) {
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess)
            fail(DFLASH_STATUS_CUDA_ERROR, "CUDA error after the op: ", cudaGetErrorName(err), " (",
                 cudaGetErrorString(err), ")");
    }
}

// ----------------------------------------------------------------------------------------------
// Comparison
// ----------------------------------------------------------------------------------------------

struct Diff {
    double rel = 0;        // ‖got − ref‖ / ‖ref‖
    double elem = 0;       // max |got − ref| / (|ref| + rms(ref))
    int64_t worst = -1;    // index of that element
    int64_t nonfinite = 0; // NaN/Inf in got (unwritten elements show up here)
    int64_t first_nonfinite = -1;
};

Diff diff(const std::vector<float> &got, const std::vector<float> &ref) {
    Diff d;
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) den += double(ref[i]) * ref[i];
    const double rms = std::sqrt(den / double(std::max<size_t>(ref.size(), 1)));
    for (size_t i = 0; i < ref.size(); ++i) {
        if (!std::isfinite(got[i])) {
            if (d.nonfinite++ == 0) d.first_nonfinite = int64_t(i);
            continue;
        }
        const double e = double(got[i]) - ref[i];
        num += e * e;
        const double scaled = std::fabs(e) / (std::fabs(double(ref[i])) + rms + 1e-30);
        if (scaled > d.elem) {
            d.elem = scaled;
            d.worst = int64_t(i);
        }
    }
    d.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    return d;
}

// ----------------------------------------------------------------------------------------------
// Groups and cases
// ----------------------------------------------------------------------------------------------

struct Totals {
    int cases = 0, failed = 0, boundary = 0;
    std::vector<std::string> failed_groups;
};
Totals g_totals;

class Case {
public:
    Case(std::string desc, uint64_t seed) : desc_(std::move(desc)), seed_(seed), rng(seed) {}

    // Values: cuda (got) vs host (ref), under `tol`.
    void close(const char *what, const std::vector<float> &got, const std::vector<float> &ref,
               double tol) {
        if (got.size() != ref.size()) {
            problem(cat(what, ": size ", got.size(), " != ", ref.size(), " (test bug)"));
            return;
        }
        for (size_t i = 0; i < ref.size(); ++i)
            if (!std::isfinite(ref[i])) {
                problem(cat(what, ": host reference is not finite at ", i, " (test bug)"));
                return;
            }
        const Diff d = diff(got, ref);
        worst_ = std::max(worst_, d.rel);
        tol_ = std::max(tol_, tol);
        if (d.nonfinite)
            problem(cat(what, ": ", d.nonfinite, " NaN/Inf element(s), first at ", d.first_nonfinite,
                        " (unwritten, or computed NaN); host there = ", ref[size_t(d.first_nonfinite)]));
        else if (d.rel > tol || d.elem > kElemFactor * tol)
            problem(cat(what, ": rel err ", d.rel, " (tol ", tol, "), worst element ", d.worst,
                        ": cuda ", got[size_t(d.worst)], " host ", ref[size_t(d.worst)]));
    }

    template <typename T>
    void equal(const char *what, const std::vector<T> &got, const std::vector<T> &ref) {
        int64_t bad = 0, first = -1;
        for (size_t i = 0; i < ref.size(); ++i)
            if (!(got[i] == ref[i]) && bad++ == 0) first = int64_t(i);
        if (bad)
            problem(cat(what, ": ", bad, " of ", ref.size(), " element(s) differ, first at ", first,
                        ": cuda ", +got[size_t(first)], " host ", +ref[size_t(first)]));
    }

    void check(bool ok, const std::string &message) {
        if (!ok) problem(message);
    }

    void boundary() { ++boundary_; }
    void problem(const std::string &message) { problems_.push_back(message); }

    const std::string &desc() const { return desc_; }
    uint64_t seed() const { return seed_; }
    double worst() const { return worst_; }
    double tol() const { return tol_; }
    int boundaries() const { return boundary_; }
    const std::vector<std::string> &problems() const { return problems_; }

private:
    std::string desc_;
    uint64_t seed_;
    double worst_ = 0, tol_ = 0;
    int boundary_ = 0;
    std::vector<std::string> problems_;

public:
    Rng rng;
};

bool cuda_context_lost() {
    // A sticky error (illegal address, launch failure) poisons the context: every later call
    // fails the same way. A transient one is cleared by the first read.
    (void)cudaGetLastError();
    if (cudaDeviceSynchronize() == cudaSuccess) return false;
    (void)cudaGetLastError();
    return cudaDeviceSynchronize() != cudaSuccess;
}

class Group {
public:
    explicit Group(std::string name)
        : name_(std::move(name)), start_(std::chrono::steady_clock::now()) {}

    bool enabled() const {
        if (g_opt.filters.empty()) return true;
        for (const auto &f : g_opt.filters)
            if (name_.find(f) != std::string::npos) return true;
        return false;
    }

    // Runs one case: body(case) prepares inputs, runs host and cuda, and checks.
    void run(const std::string &desc, const std::function<void(Case &)> &body) {
        const uint64_t seed = mix64(g_opt.seed ^ mix64(hash_str(name_) + uint64_t(index_++)));
        Case c(desc, seed);
        const auto t0 = std::chrono::steady_clock::now();
        try {
            body(c);
        } catch (const Error &e) {
            c.problem(cat("threw ", dflash_status_string(e.status()), ": ", e.what()));
        } catch (const std::exception &e) {
            c.problem(cat("threw: ", e.what()));
        }
        ++cases_;
        worst_ = std::max(worst_, c.worst());
        tol_ = std::max(tol_, c.tol());
        boundary_ += c.boundaries();
        if (!c.problems().empty()) {
            ++failed_;
            if (failed_ <= 5 || g_opt.verbose) {
                std::printf("  FAIL %s [%s] case seed 0x%016" PRIx64 "\n", name_.c_str(),
                            desc.c_str(), seed);
                for (size_t i = 0; i < c.problems().size() && i < 4; ++i)
                    std::printf("       %s\n", c.problems()[i].c_str());
            }
            if (is_cuda(*C) && cuda_context_lost()) {
                std::printf("FATAL: the CUDA context is lost (sticky error) after %s [%s]; "
                            "stopping. Rerun: test_ops --seed %" PRIu64 " --filter %s\n",
                            name_.c_str(), desc.c_str(), g_opt.seed, name_.c_str());
                finish();
                std::printf("FAILED: %d of %d case(s)\n", g_totals.failed, g_totals.cases);
                std::fflush(stdout);
                std::exit(std::min(std::max(g_totals.failed, 1), 255));
            }
        } else if (g_opt.verbose) {
            std::printf("  ok   %s [%s] rel %.2e%s  %.3f s\n", name_.c_str(), desc.c_str(), c.worst(),
                        c.boundaries() ? " (near-boundary case accepted)" : "",
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        std::fflush(stdout);
    }

    void finish() {
        if (finished_) return;
        finished_ = true;
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
        std::string err = tol_ > 0 ? cat("worst rel ", fmt(worst_), " / tol ", fmt(tol_)) : "exact";
        std::printf("%s %-16s %4d case(s)%s  %s%s  %.2f s\n", failed_ ? "FAIL" : "PASS",
                    name_.c_str(), cases_, failed_ ? cat(", ", failed_, " FAILED").c_str() : "",
                    err.c_str(), boundary_ ? cat(", ", boundary_, " near-boundary").c_str() : "",
                    secs);
        std::fflush(stdout);
        g_totals.cases += cases_;
        g_totals.failed += failed_;
        g_totals.boundary += boundary_;
        if (failed_) g_totals.failed_groups.push_back(name_);
    }

    ~Group() { finish(); }

private:
    static std::string fmt(double v) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.2e", v);
        return buf;
    }

    std::string name_;
    std::chrono::steady_clock::time_point start_;
    int index_ = 0, cases_ = 0, failed_ = 0, boundary_ = 0;
    double worst_ = 0, tol_ = 0;
    bool finished_ = false;
};

// ----------------------------------------------------------------------------------------------
// --self-test: a bf16 emulation of the cuda backend on the CPU
// ----------------------------------------------------------------------------------------------
//
// The host ops with bf16 activations and weights: inputs are widened to fp32, the host op runs,
// results are rounded to bf16 (NaN bit patterns kept, so poison stays poison). It lets the harness
// itself be checked without a GPU: `test_ops --self-test` must print ALL OK, and
// `--self-test --inject-fault OP` (one wrong element in OP's output) must fail exactly OP.
class EmulatedBf16Backend final : public Backend {
public:
    EmulatedBf16Backend(std::shared_ptr<Backend> host, std::string fault)
        : h_(std::move(host)), fault_(std::move(fault)) {}

    dflash_backend kind() const override { return DFLASH_BACKEND_HOST; }
    dflash_dtype act_dtype() const override { return DFLASH_DTYPE_BF16; }
    dflash_dtype weight_dtype(dflash_dtype) const override { return DFLASH_DTYPE_BF16; }
    void *alloc(size_t bytes) override { return h_->alloc(bytes); }
    void release(void *ptr) noexcept override { h_->release(ptr); }
    void upload(void *dst, const void *src, size_t bytes) override { std::memcpy(dst, src, bytes); }
    void download(void *dst, const void *src, size_t bytes) override { std::memcpy(dst, src, bytes); }
    void copy(void *dst, const void *src, size_t bytes) override { std::memmove(dst, src, bytes); }
    void synchronize() override {}

    void convert_rows(const void *src, dflash_dtype dt, bool, int64_t n, int64_t width,
                      void *dst) override {
        std::vector<float> y(static_cast<size_t>(n * width));
        h_->convert_rows(src, dt, false, n, width, y.data());
        put(dst, y, "convert_rows");
    }
    void embed(const int32_t *tokens, int64_t n, WeightView table, float scale, void *out, float *ss_out) override {
        std::vector<float> y(static_cast<size_t>(n * table.cols));
        h_->embed(tokens, n, table, scale, y.data());
        put(out, y, "embed");
        if (ss_out)  // of the stored (bf16-rounded) values, as the cuda kernel sums them
            sum_square_parts(get(out, y.size()).data(), n, table.cols, table.cols, ss_out);
    }
    void rms_norm(const void *x, int64_t rows, int64_t groups, int64_t dim, int64_t ld_x,
                  WeightView w, float eps, void *y, int64_t ld_y) override {
        std::vector<float> xf = get(x, size_t((rows - 1) * ld_x + groups * dim));
        std::vector<float> yf = x == y ? xf : get(y, size_t((rows - 1) * ld_y + groups * dim));
        h_->rms_norm(xf.data(), rows, groups, dim, ld_x, w, eps, yf.data(), ld_y);
        put(y, yf, "rms_norm");
    }
    // The tiled GEMM layout (backend.hpp): the host backend tiles and reads tiled views itself.
    void tile_gemm_weight(const WeightView &src, void *dst) override { h_->tile_gemm_weight(src, dst); }
    void fold_norm(WeightView w, WeightView g) override { h_->fold_norm(w, g); }
    void gemm(const void *x, int64_t m, int64_t ldx, WeightView w, void *y, int64_t ldy, GemmRows,
              GemmFuse fuse) override {
        std::vector<float> xf = get(x, size_t((m - 1) * ldx + w.cols));
        std::vector<float> yf = get(y, size_t((m - 1) * ldy + w.rows));
        GemmFuse f = fuse;
        f.ss_out = nullptr;
        h_->gemm(xf.data(), m, ldx, w, yf.data(), ldy, GemmRows::Uniform, f);
        put(y, yf, "gemm");
        if (fuse.ss_out)  // of the stored (bf16-rounded) values, as the cuda epilogue sums them
            sum_square_parts(get(y, size_t((m - 1) * ldy + w.rows)).data(), m, w.rows, ldy, fuse.ss_out);
    }
    void rope(void *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
              const int32_t *positions, const float *inv_freq, float factor) override {
        std::vector<float> xf = get(x, size_t((rows - 1) * ld + heads * head_dim));
        h_->rope(xf.data(), rows, heads, head_dim, ld, positions, inv_freq, factor);
        put(x, xf, "rope");
    }
    void kv_write(const void *k, const void *v, int64_t rows, int64_t ld, const int32_t *slots,
                  int64_t kv_width, void *k_cache, void *v_cache) override {
        int64_t last = -1;  // the last row written (slot >= 0; a negative slot is a padding row)
        for (int64_t r = 0; r < rows; ++r) {  // a copy of bf16 rows
            if (slots[r] < 0) continue;
            last = r;
            std::memcpy(static_cast<uint16_t *>(k_cache) + int64_t(slots[r]) * kv_width,
                        static_cast<const uint16_t *>(k) + r * ld, size_t(kv_width) * 2);
            std::memcpy(static_cast<uint16_t *>(v_cache) + int64_t(slots[r]) * kv_width,
                        static_cast<const uint16_t *>(v) + r * ld, size_t(kv_width) * 2);
        }
        if (fault_ == "kv_write" && last >= 0) static_cast<uint16_t *>(k_cache)[int64_t(slots[last]) * kv_width] ^= 0x80;
    }
    void attention(const void *q, int64_t ldq, int64_t nq, const int32_t *q_positions, int64_t n_heads,
                   int64_t n_kv_heads, int64_t head_dim, float scale, AttentionMask mask,
                   const PagedKeys &keys, void *out) override {
        int64_t blocks = 0;
        for (int64_t b = 0; b < keys.ring_slots / keys.block_size; ++b)
            blocks = std::max<int64_t>(blocks, keys.block_table[b] + 1);
        const size_t cache = size_t(blocks * keys.block_size * n_kv_heads * head_dim);
        std::vector<float> kf = get(keys.k_cache, cache), vf = get(keys.v_cache, cache);
        PagedKeys fk = keys;
        fk.k_cache = kf.data();
        fk.v_cache = vf.data();
        std::vector<float> qf = get(q, size_t((nq - 1) * ldq + n_heads * head_dim)),
                           y(size_t(nq * n_heads * head_dim));
        h_->attention(qf.data(), ldq, nq, q_positions, n_heads, n_kv_heads, head_dim, scale, mask, fk,
                      y.data());
        put(out, y, "attention");
    }
    void add(void *y, const void *x, int64_t n) override {
        std::vector<float> yf = get(y, size_t(n)), xf = get(x, size_t(n));
        h_->add(yf.data(), xf.data(), n);
        put(y, yf, "add");
    }
    void swiglu(const void *gate_up, int64_t rows, int64_t inter, void *out) override {
        std::vector<float> g = get(gate_up, size_t(rows * 2 * inter)), y(size_t(rows * inter));
        h_->swiglu(g.data(), rows, inter, y.data());
        put(out, y, "swiglu");
    }
    void logits_argmax(const void *hs, int64_t m, WeightView lm_head, float multiplier,
                       float softcap, int32_t *tokens) override {
        std::vector<float> hf = get(hs, size_t(m * lm_head.cols));
        h_->logits_argmax(hf.data(), m, lm_head, multiplier, softcap, tokens);
        if (fault_ == "logits_argmax") tokens[m - 1] = int32_t((tokens[m - 1] + 1) % lm_head.rows);
    }
    void copy_rows(const void *src, int64_t ld_src, int64_t rows, int64_t width, void *dst,
                   int64_t ld_dst) override {
        for (int64_t r = 0; r < rows; ++r)
            std::memcpy(static_cast<uint16_t *>(dst) + r * ld_dst,
                        static_cast<const uint16_t *>(src) + r * ld_src, size_t(width) * 2);
        if (fault_ == "copy_rows") static_cast<uint16_t *>(dst)[(rows - 1) * ld_dst + width - 1] ^= 0x80;
    }
    void logits(const void *hs, int64_t m, WeightView lm_head, float multiplier, float softcap,
                float *out) override {
        std::vector<float> hf = get(hs, size_t(m * lm_head.cols));
        h_->logits(hf.data(), m, lm_head, multiplier, softcap, out);
        if (fault_ == "logits") out[m * lm_head.rows - 1] += 1.f;
    }
    void sampling_probs(float *rows, int64_t m, int64_t vocab, float temperature, float top_p,
                        int32_t top_k) override {
        h_->sampling_probs(rows, m, vocab, temperature, top_p, top_k);
        if (fault_ == "sampling_probs") {  // move mass between the two likeliest tokens of the last row
            float *row = rows + (m - 1) * vocab;
            const int64_t a = std::max_element(row, row + vocab) - row;
            const int64_t b = a == 0 ? 1 : 0;
            row[b] += 0.25f * row[a];
            row[a] *= 0.75f;
        }
    }
    void sample_rows(const float *probs, int64_t m, int64_t vocab, RngKey key, uint32_t first_row,
                     uint32_t purpose, int32_t *out) override {
        h_->sample_rows(probs, m, vocab, key, first_row, purpose, out);
        if (fault_ == "sample_rows") {  // the next token with nonzero probability: a wrong draw
            const float *row = probs + (m - 1) * vocab;
            int32_t t = out[m - 1];
            do t = int32_t((t + 1) % vocab); while (!(row[t] > 0.f) && t != out[m - 1]);
            out[m - 1] = t;
        }
    }
    void greedy_accept(const int32_t *tokens, const int32_t *posterior, int64_t n,
                       int32_t *out) override {
        h_->greedy_accept(tokens, posterior, n, out);
        if (fault_ == "greedy_accept") out[1] += 1;
    }
    void rejection_accept(const float *p, const int32_t *tokens, const float *q, int64_t n,
                          int64_t vocab, RngKey key, int32_t *out) override {
        h_->rejection_accept(p, tokens, q, n, vocab, key, out);
        if (fault_ == "rejection_accept") out[0] = out[0] + 1 < n ? out[0] + 1 : out[0] - 1 + (n == 1);
    }

private:
    static std::vector<float> get(const void *p, size_t n) {
        std::vector<float> v(n);
        for (size_t i = 0; i < n; ++i) v[i] = bf16_to_float(static_cast<const uint16_t *>(p)[i]);
        return v;
    }
    // Rounds to bf16; a NaN keeps its upper bits, so 0xFFFF poison survives the round trip.
    void put(void *p, std::vector<float> &v, const char *op) const {
        if (fault_ == op) v[v.size() - 1] = v[v.size() - 1] * 1.5f + 1.f;
        for (size_t i = 0; i < v.size(); ++i) {
            uint32_t bits;
            std::memcpy(&bits, &v[i], 4);
            static_cast<uint16_t *>(p)[i] = std::isnan(v[i]) ? uint16_t(bits >> 16) : bf16_bits_rne(v[i]);
        }
    }

    std::shared_ptr<Backend> h_;
    std::string fault_;
};

// ----------------------------------------------------------------------------------------------
// convert_rows
// ----------------------------------------------------------------------------------------------

void test_convert_rows() {
    Group g("convert_rows");
    if (!g.enabled()) return;
    std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 64}, {17, 296}, {97, 4096}};
    if (g_opt.level == SMOKE) shapes = {{17, 296}};
    for (dflash_dtype dt : {DFLASH_DTYPE_F32, DFLASH_DTYPE_F16, DFLASH_DTYPE_BF16})
        for (bool on_device : {false, true})
            for (auto [n, width] : shapes)
                g.run(cat(dtype_name(dt), on_device ? " device" : " host", " n=", n, " width=", width),
                      [&, n = n, width = width](Case &c) {
                          const size_t count = size_t(n * width);
                          std::vector<uint8_t> src(count * dtype_size(dt));
                          for (size_t i = 0; i < count; ++i) {
                              if (dt == DFLASH_DTYPE_F32) {
                                  const float f = c.rng.normal(3.f);  // not bf16-exact: tests rounding
                                  std::memcpy(src.data() + 4 * i, &f, 4);
                              } else if (dt == DFLASH_DTYPE_F16) {  // normal halves in ~[2^-4, 2^5)
                                  const uint16_t h = uint16_t((c.rng.bits() & 1) << 15 |
                                                              (11 + c.rng.index(10)) << 10 |
                                                              c.rng.index(1024));
                                  std::memcpy(src.data() + 2 * i, &h, 2);
                              } else {
                                  const uint16_t h = bf16_bits_rne(c.rng.normal(3.f));
                                  std::memcpy(src.data() + 2 * i, &h, 2);
                              }
                          }
                          DeviceBuffer out_h = poisoned(*H, count * act_size(*H));
                          H->convert_rows(src.data(), dt, false, n, width, out_h.get());
                          DeviceBuffer out_c = poisoned(*C, count * act_size(*C));
                          DeviceBuffer src_c;
                          if (on_device) src_c = upload_bytes(*C, src.data(), src.size());
                          C->convert_rows(on_device ? src_c.get() : src.data(), dt, on_device, n,
                                          width, out_c.get());
                          sync(*C);
                          const std::vector<float> ref = download_act(*H, out_h.get(), count);
                          const std::vector<float> got = download_act(*C, out_c.get(), count);
                          c.close("out", got, ref, kTolBf16);
                          // The conversion itself is exact: round-to-nearest-even of the source.
                          std::vector<float> rne(count);
                          for (size_t i = 0; i < count; ++i) rne[i] = round_bf16(ref[i]);
                          if (c.problems().empty()) c.equal("out vs RNE(src)", got, rne);
                      });
}

// ----------------------------------------------------------------------------------------------
// embed
// ----------------------------------------------------------------------------------------------

// GemmFuse's row statistics of x[m, k] (bf16-exact values): each row's sum of squares per 16 columns.
std::vector<float> sq_parts(const std::vector<float> &x, int64_t m, int64_t k) {
    std::vector<float> out(size_t(m * ss_parts(k)));
    sum_square_parts(x.data(), m, k, k, out.data());
    return out;
}

void test_embed() {
    Group g("embed");
    if (!g.enabled()) return;
    struct Shape { int64_t n, vocab, hidden; float scale; };
    std::vector<Shape> shapes = {{1, 1000, 64, 1.f}, {17, 1000, 1024, 0.125f},
                                 {97, 5000, 4096, 8.f}, {16, 1000, 1024, std::sqrt(1024.f) * 0.7f},
                                 {5, 300, 100, 0.5f}};  // H not a multiple of 16: a short last part
    if (g_opt.level == SMOKE) shapes = {{17, 1000, 1024, 0.125f}};
    for (const Shape &s : shapes)
      for (bool stats : {false, true})  // stats: with the rows' sums of squares (ss_out), the folded q/k/v's input
        g.run(cat("n=", s.n, " vocab=", s.vocab, " H=", s.hidden, " scale=", s.scale, stats ? " ss_out" : ""),
              [&](Case &c) {
            const std::vector<float> table = c.rng.bf16_normal(size_t(s.vocab * s.hidden));
            std::vector<int32_t> tokens(size_t(s.n));
            for (auto &t : tokens) t = int32_t(c.rng.index(s.vocab));
            tokens[0] = int32_t(s.vocab - 1);
            if (s.n > 1) tokens[1] = 0;
            Weight w_h = upload_weight(*H, table, s.vocab, s.hidden);
            Weight w_c = upload_weight(*C, table, s.vocab, s.hidden);
            DeviceBuffer tok_h = upload_vec(*H, tokens), tok_c = upload_vec(*C, tokens);
            const size_t count = size_t(s.n * s.hidden);
            DeviceBuffer out_h = poisoned(*H, count * act_size(*H));
            DeviceBuffer out_c = poisoned(*C, count * act_size(*C));
            const size_t n_ss = size_t(s.n * ss_parts(s.hidden));
            DeviceBuffer ss_c = poisoned(*C, (stats ? n_ss : 1) * sizeof(float));
            H->embed(tok_h.as<int32_t>(), s.n, w_h.view, s.scale, out_h.get());
            C->embed(tok_c.as<int32_t>(), s.n, w_c.view, s.scale, out_c.get(), stats ? ss_c.as<float>() : nullptr);
            sync(*C);
            const std::vector<float> out_cuda = download_act(*C, out_c.get(), count);
            c.close("out", out_cuda, download_act(*H, out_h.get(), count), kTolBf16);
            if (stats)  // the sums of squares of what cuda stored, in fp32
                c.close("ss_out", download_vec<float>(*C, ss_c.get(), n_ss), sq_parts(out_cuda, s.n, s.hidden), 1e-5);
        });
}

// ----------------------------------------------------------------------------------------------
// rms_norm
// ----------------------------------------------------------------------------------------------

void test_rms_norm() {
    Group g("rms_norm");
    if (!g.enabled()) return;
    struct Shape { int64_t rows, groups, dim, pad_x, pad_y; bool in_place; };
    std::vector<Shape> shapes = {
        {1, 1, 64, 0, 0, false},     {17, 1, 1024, 0, 0, false},   {97, 1, 4096, 64, 8, false},
        {7, 32, 128, 2048, 0, true},  // q_norm inside a fused qkv row
        {17, 8, 128, 1024, 1024, true}, {97, 4, 64, 256, 0, false}, {16, 2, 1024, 0, 0, false},
        {2, 2, 64, 0, 0, true},
        {3, 1, 12288, 0, 8, false},   // two 16-byte pieces for some threads of the vector kernel
        {2, 1, 16400, 0, 0, true}};   // past the vector kernel's 16384: the scalar kernel
    if (g_opt.level == SMOKE) shapes = {{17, 8, 128, 1024, 1024, true}, {17, 1, 1024, 0, 0, false}};
    for (const Shape &s : shapes)
        g.run(cat("rows=", s.rows, " groups=", s.groups, " dim=", s.dim, " ld_x=+", s.pad_x,
                  s.in_place ? " in-place" : cat(" ld_y=+", s.pad_y)),
              [&](Case &c) {
                  const int64_t width = s.groups * s.dim;
                  const int64_t ld_x = width + s.pad_x;
                  const int64_t ld_y = s.in_place ? ld_x : width + s.pad_y;
                  const std::vector<float> x = c.rng.bf16_normal(size_t(s.rows * ld_x), 2.f);
                  std::vector<float> w(size_t(s.dim));
                  for (auto &v : w) v = round_bf16(1.f + c.rng.normal(0.2f));
                  Weight w_h = upload_weight(*H, w, 1, s.dim), w_c = upload_weight(*C, w, 1, s.dim);
                  DeviceBuffer x_h = upload_act(*H, x), x_c = upload_act(*C, x);
                  DeviceBuffer y_h, y_c;
                  if (!s.in_place) {
                      y_h = poisoned(*H, size_t(s.rows * ld_y) * act_size(*H));
                      y_c = poisoned(*C, size_t(s.rows * ld_y) * act_size(*C));
                  }
                  void *yh = s.in_place ? x_h.get() : y_h.get();
                  void *yc = s.in_place ? x_c.get() : y_c.get();
                  H->rms_norm(x_h.get(), s.rows, s.groups, s.dim, ld_x, w_h.view, 1e-6f, yh, ld_y);
                  C->rms_norm(x_c.get(), s.rows, s.groups, s.dim, ld_x, w_c.view, 1e-6f, yc, ld_y);
                  sync(*C);
                  const size_t total = size_t(s.rows * ld_y);
                  const std::vector<uint8_t> raw_c = download_bytes(*C, yc, total * act_size(*C));
                  const std::vector<float> all_h = download_act(*H, yh, total);
                  const std::vector<float> all_c = decode(C->act_dtype(), raw_c);
                  std::vector<float> got, ref;
                  int64_t pad_changed = 0;
                  for (int64_t r = 0; r < s.rows; ++r)
                      for (int64_t col = 0; col < ld_y; ++col) {
                          const size_t i = size_t(r * ld_y + col);
                          if (col < width) {
                              got.push_back(all_c[i]);
                              ref.push_back(all_h[i]);
                          } else if (s.in_place ? all_c[i] != x[i]
                                                : !still_poisoned(raw_c, act_size(*C), i)) {
                              ++pad_changed;
                          }
                      }
                  c.close("y", got, ref, kTolBf16);
                  c.check(pad_changed == 0, cat(pad_changed, " element(s) between rows (ld padding) were"
                                                " written"));
              });
}

// An in-place op's result over `rows` rows of `width` used elements at row stride ld: the used
// elements from cuda (got) and host (ref), and how many padding elements cuda changed from `input`.
struct InPlaceRows {
    std::vector<float> got, ref;
    int64_t pad_changed = 0;
};

InPlaceRows in_place_rows(const std::vector<float> &all_c, const std::vector<float> &all_h,
                          const std::vector<float> &input, int64_t rows, int64_t ld, int64_t width) {
    InPlaceRows out;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t col = 0; col < ld; ++col) {
            const size_t i = size_t(r * ld + col);
            if (col < width) {
                out.got.push_back(all_c[i]);
                out.ref.push_back(all_h[i]);
            } else if (all_c[i] != input[i]) {
                ++out.pad_changed;
            }
        }
    return out;
}

// The same for an output that started poisoned: the first `width` of each of `rows` rows of ld (cuda,
// raw bytes, against the host), and the count of the rest of the buffer (past width, past the last
// row) no longer poisoned.
InPlaceRows poisoned_rows(const std::vector<uint8_t> &raw_c, dflash_dtype act, const std::vector<float> &all_h,
                          int64_t rows, int64_t ld, int64_t width) {
    const std::vector<float> all_c = decode(act, raw_c);
    const size_t elem = dtype_size(act);
    InPlaceRows out;
    for (size_t i = 0; i < all_c.size(); ++i) {
        const int64_t r = int64_t(i) / ld, col = int64_t(i) % ld;
        if (r < rows && col < width) {
            out.got.push_back(all_c[i]);
            out.ref.push_back(all_h[i]);
        } else if (!still_poisoned(raw_c, elem, i)) {
            ++out.pad_changed;
        }
    }
    return out;
}

// A GEMM case's inputs on both backends: x [m, ldx] and a weight of `stored` rows x k (bf16-exact
// normals), viewed from row slice_first for `rows` rows (tiled on the cuda side if asked), and poisoned
// outputs of `total` elements.
struct GemmInputs {
    Weight w_h, w_c;
    WeightView v_h, v_c;
    DeviceBuffer x_h, x_c, y_h, y_c;
    size_t total;
    GemmInputs(Case &c, int64_t m, int64_t k, int64_t ldx, int64_t rows, int64_t stored, int64_t slice_first,
               bool tiled, size_t total_out)
        : total(total_out) {
        const std::vector<float> x = c.rng.bf16_normal(size_t(m * ldx));
        const std::vector<float> w = c.rng.bf16_normal(size_t(stored * k), 1.f / std::sqrt(float(k)));
        w_h = upload_weight(*H, w, stored, k);
        w_c = upload_weight(*C, w, stored, k);
        if (tiled) w_c = tiled_weight(*C, w_c);
        v_h = w_h.view.slice_rows(slice_first, rows);
        v_c = w_c.view.slice_rows(slice_first, rows);
        x_h = upload_act(*H, x);
        x_c = upload_act(*C, x);
        y_h = poisoned(*H, total * act_size(*H));
        y_c = poisoned(*C, total * act_size(*C));
    }
    // poisoned_rows of the outputs (after the calls and a sync)
    InPlaceRows outputs(int64_t rows, int64_t ld, int64_t width) const {
        return poisoned_rows(download_bytes(*C, y_c.get(), total * act_size(*C)), C->act_dtype(),
                             download_act(*H, y_h.get(), total), rows, ld, width);
    }
};

// ----------------------------------------------------------------------------------------------
// add_rms_norm, head_norm_rope (the fused ops; the host runs their composed defaults)
// ----------------------------------------------------------------------------------------------

void test_add_rms_norm() {
    Group g("add_rms_norm");
    if (!g.enabled()) return;
    struct Shape { int64_t rows, dim; };
    // 12288: two pieces for some threads; 16400: past the one-kernel form's 16384 (an add, then a norm)
    std::vector<Shape> shapes = {{1, 64}, {17, 1024}, {16, 4096}, {97, 2560}, {3, 36}, {3, 12288}, {2, 16400}};
    if (g_opt.level == SMOKE) shapes = {{17, 1024}, {3, 36}};
    for (const Shape &s : shapes)
        g.run(cat("rows=", s.rows, " dim=", s.dim, " y aliases res"), [&](Case &c) {
            const size_t n = size_t(s.rows * s.dim);
            const std::vector<float> x = c.rng.bf16_normal(n, 2.f), r = c.rng.bf16_normal(n, 1.f);
            std::vector<float> w(size_t(s.dim));
            for (auto &v : w) v = round_bf16(1.f + c.rng.normal(0.2f));
            Weight w_h = upload_weight(*H, w, 1, s.dim), w_c = upload_weight(*C, w, 1, s.dim);
            DeviceBuffer x_h = upload_act(*H, x), x_c = upload_act(*C, x);
            DeviceBuffer r_h = upload_act(*H, r), r_c = upload_act(*C, r);
            H->add_rms_norm(x_h.get(), r_h.get(), s.rows, s.dim, w_h.view, 1e-6f, r_h.get());
            C->add_rms_norm(x_c.get(), r_c.get(), s.rows, s.dim, w_c.view, 1e-6f, r_c.get());
            sync(*C);
            c.close("x (sum)", download_act(*C, x_c.get(), n), download_act(*H, x_h.get(), n), kTolBf16);
            c.close("y (normed)", download_act(*C, r_c.get(), n), download_act(*H, r_h.get(), n), kTolBf16);
        });
}

// Random positions below max_pos, and RoPE's inverse frequencies theta^(-2i / head_dim).
std::vector<int32_t> random_positions(Rng &rng, int64_t rows, int32_t max_pos) {
    std::vector<int32_t> pos(static_cast<size_t>(rows));
    for (auto &p : pos) p = int32_t(rng.index(max_pos));
    return pos;
}
std::vector<float> rope_inv_freq(int64_t head_dim, float theta) {
    std::vector<float> inv_freq(size_t(head_dim / 2));
    for (int64_t i = 0; i < head_dim / 2; ++i)
        inv_freq[size_t(i)] = 1.f / std::pow(theta, float(2 * i) / float(head_dim));
    return inv_freq;
}

void test_head_norm_rope() {
    Group g("head_norm_rope");
    if (!g.enabled()) return;
    struct Shape { int64_t rows, heads, head_dim, pad; bool norm; };
    std::vector<Shape> shapes = {{1, 32, 128, 0, true}, {16, 8, 128, 8 * 128, true}, {17, 4, 64, 64, true},
                                 {7, 32, 128, 0, false}, {5, 2, 256, 0, true}, {3, 3, 20, 4, true}};
    if (g_opt.level == SMOKE) shapes = {{16, 8, 128, 8 * 128, true}, {3, 3, 20, 4, true}};
    for (const Shape &s : shapes)
        g.run(cat("rows=", s.rows, " heads=", s.heads, " head_dim=", s.head_dim, " ld=+", s.pad,
                  s.norm ? "" : " no norm"),
              [&](Case &c) {
                  const int64_t ld = s.heads * s.head_dim + s.pad;
                  const std::vector<float> x = c.rng.bf16_normal(size_t(s.rows * ld), 1.5f);
                  std::vector<float> w(size_t(s.head_dim));
                  for (auto &v : w) v = round_bf16(1.f + c.rng.normal(0.2f));
                  const std::vector<int32_t> pos = random_positions(c.rng, s.rows, 40000);
                  const std::vector<float> inv_freq = rope_inv_freq(s.head_dim, 1e6f);
                  Weight w_h = upload_weight(*H, w, 1, s.head_dim), w_c = upload_weight(*C, w, 1, s.head_dim);
                  DeviceBuffer x_h = upload_act(*H, x), x_c = upload_act(*C, x);
                  DeviceBuffer p_h = upload_vec(*H, pos), p_c = upload_vec(*C, pos);
                  DeviceBuffer f_h = upload_vec(*H, inv_freq), f_c = upload_vec(*C, inv_freq);
                  H->head_norm_rope(x_h.get(), s.rows, s.heads, s.head_dim, ld, s.norm ? &w_h.view : nullptr,
                                    1e-6f, p_h.as<int32_t>(), f_h.as<float>(), 1.f);
                  C->head_norm_rope(x_c.get(), s.rows, s.heads, s.head_dim, ld, s.norm ? &w_c.view : nullptr,
                                    1e-6f, p_c.as<int32_t>(), f_c.as<float>(), 1.f);
                  sync(*C);
                  const size_t total = size_t(s.rows * ld);
                  const std::vector<float> all_h = download_act(*H, x_h.get(), total);
                  const std::vector<float> all_c = download_act(*C, x_c.get(), total);
                  const InPlaceRows rows = in_place_rows(all_c, all_h, x, s.rows, ld, s.heads * s.head_dim);
                  const int64_t pad_changed = rows.pad_changed;
                  c.close("x", rows.got, rows.ref, kTolBf16);
                  c.check(pad_changed == 0, cat(pad_changed, " padding element(s) written"));
              });
}

// ----------------------------------------------------------------------------------------------
// gemm
// ----------------------------------------------------------------------------------------------

void test_gemm() {
    Group g("gemm");
    if (!g.enabled()) return;
    std::vector<int64_t> ms = {1, 2, 7, 16, 17, 97};
    struct NK { int64_t n, k; };
    std::vector<NK> nks = {{1, 64}, {17, 64}, {300, 136}, {1000, 512}, {2056, 1024}, {64, 4096}};
    if (g_opt.level == QUICK) {
        ms = {1, 7, 16, 17};  // 16: whole tiles (the ring-fed kernel's plain x loads)
        nks = {{1, 64}, {17, 64}, {300, 136}};
    }
    if (g_opt.level == SMOKE) {
        ms = {1, 17};
        nks = {{17, 64}, {300, 136}};
    }
    int idx = 0;
    // tiled: the cuda side reads the weight in the tiled layout (sliced at a tile boundary).
    auto one = [&](int64_t m, int64_t n, int64_t k, int64_t pad_x, int64_t pad_y, int64_t slice_first,
                   bool tiled) {
        g.run(cat("M=", m, " N=", n, " K=", k, pad_x ? cat(" ldx=+", pad_x) : "",
                  pad_y ? cat(" ldy=+", pad_y) : "", slice_first ? cat(" rows from ", slice_first) : "",
                  tiled ? " tiled" : ""),
              [&](Case &c) {
                  const int64_t ldx = k + pad_x, ldy = n + pad_y;
                  GemmInputs in(c, m, k, ldx, n, n + slice_first + 3, slice_first, tiled, size_t(m * ldy));
                  H->gemm(in.x_h.get(), m, ldx, in.v_h, in.y_h.get(), ldy);
                  C->gemm(in.x_c.get(), m, ldx, in.v_c, in.y_c.get(), ldy);
                  sync(*C);
                  const InPlaceRows rows = in.outputs(m, ldy, n);
                  c.close("y", rows.got, rows.ref, kTolBf16);
                  c.check(rows.pad_changed == 0, cat(rows.pad_changed, " padding element(s) written"));
              });
    };
    for (int64_t m : ms)
        for (const NK &nk : nks) {
            const int64_t pad_x = (idx % 3 == 1) ? 8 : 0;
            const int64_t pad_y = (idx % 4 == 2) ? 8 : 0;
            const int64_t slice_first = (idx % 5 == 3) ? 5 : 0;
            ++idx;
            one(m, nk.n, nk.k, pad_x, pad_y, slice_first, false);
            one(m, nk.n, nk.k, pad_x, pad_y, slice_first ? kTileRows : 0, true);
        }
    // tiled: 768 column blocks, a persistent launch of 3 per block on an H200 (under DFLASH_GEMM_PERSIST=3)
    if (g_opt.level >= QUICK)
        for (int64_t m : {int64_t(1), int64_t(16), int64_t(17)}) one(m, 12288, 1024, 0, m == 17 ? 8 : 0, 0, true);
    if (g_opt.level >= DEFAULT) {  // prefill-sized M
        one(300, 512, 512, 0, 0, 0, false);
        one(257, 300, 1024, 64, 8, 2, false);
        one(1000, 136, 256, 0, 0, 0, false);
        one(257, 300, 1000, 8, 8, kTileRows, true);  // K not a multiple of the 64-wide tile
    }
}

// Rows of a 16-row call (a verify block: whole tiles, plain x loads) against the same rows computed
// alone (M = 1, a decode step), in a 7-row call and in a 33-row call (three row tiles): equal bit for
// bit, for gemm and the fused gemm_swiglu, row-major and tiled weights (DESIGN §5: every output row
// is summed in the same order whatever M is). cuda only.
void test_gemm_rows_agree() {
    Group g("gemm_rows");
    if (!g.enabled()) return;
    struct Shape { int64_t n, k; bool swiglu; };  // swiglu: n is the intermediate size
    std::vector<Shape> shapes = {{300, 136, false}, {2056, 1024, false}, {64, 4096, false},
                                 {640, 136, true},  {1024, 512, true},
                                 {12288, 1024, false}, {12288, 1024, true}};  // tiled: persistent under =3
    if (g_opt.level == SMOKE) shapes = {{300, 136, false}, {640, 136, true}};
    for (const Shape &sh : shapes)
        for (bool tiled : {false, true})
          for (bool norm : {false, true})  // norm: a folded RMSNorm (GemmFuse): each row's own sum of squares
            g.run(cat(sh.swiglu ? "gemm_swiglu inter=" : "gemm N=", sh.n, " K=", sh.k, tiled ? " tiled" : "",
                      norm ? " norm" : "", ": M=16 rows vs M=1, 7, 33"),
                  [&](Case &c) {
                      Backend &be = *C;
                      const int64_t w_rows = sh.swiglu ? 2 * sh.n : sh.n, k = sh.k, n = sh.n;
                      const std::vector<float> x = c.rng.bf16_normal(size_t(33 * k));
                      const std::vector<float> w =
                          c.rng.bf16_normal(size_t(w_rows * k), 1.f / std::sqrt(float(k)));
                      Weight wc = upload_weight(be, w, w_rows, k);
                      if (tiled) wc = tiled_weight(be, wc);
                      DeviceBuffer xc = upload_act(be, x);
                      DeviceBuffer scratch(&be, size_t(33 * w_rows) * act_size(be));
                      const std::vector<float> parts = sq_parts(x, 33, k);  // norm: each row's own, per 16 columns
                      DeviceBuffer ss_in = upload_bytes(be, parts.data(), parts.size() * sizeof(float));
                      // y rows of x rows [row0, row0 + m)
                      auto rows = [&](int64_t row0, int64_t m) {
                          DeviceBuffer y = poisoned(be, size_t(m * n) * act_size(be));
                          const char *xr = static_cast<const char *>(xc.get()) + size_t(row0 * k) * act_size(be);
                          GemmFuse fuse{norm ? 1e-6f : 0.f, false};
                          if (norm) fuse.ss_in = ss_in.as<float>() + row0 * ss_parts(k);
                          if (sh.swiglu)
                              be.gemm_swiglu(xr, m, k, wc.view, n, scratch.get(), y.get(), GemmRows::Uniform, fuse);
                          else
                              be.gemm(xr, m, k, wc.view, y.get(), n, GemmRows::Uniform, fuse);
                          sync(be);
                          return download_act(be, y.get(), size_t(m * n));
                      };
                      const std::vector<float> block = rows(0, 16);
                      auto row_of = [&](const std::vector<float> &all, int64_t r) {
                          return std::vector<float>(all.begin() + r * n, all.begin() + (r + 1) * n);
                      };
                      for (int64_t r : {int64_t(0), int64_t(5), int64_t(15)})
                          c.equal(cat("row ", r, " alone").c_str(), rows(r, 1), row_of(block, r));
                      const std::vector<float> seven = rows(0, 7), wide = rows(0, 33);
                      for (int64_t r = 0; r < 7; ++r)
                          c.equal(cat("row ", r, " of 7").c_str(), row_of(seven, r), row_of(block, r));
                      const std::vector<float> block2 = rows(16, 16);  // rows 16..31: the 33-row call's second tile
                      for (int64_t r = 0; r < 16; ++r) {
                          c.equal(cat("row ", r, " of 33").c_str(), row_of(wide, r), row_of(block, r));
                          c.equal(cat("row ", 16 + r, " of 33").c_str(), row_of(wide, 16 + r), row_of(block2, r));
                      }
                  });
}

// The fused GEMM + SwiGLU (the MLP's gate_up and its activation) against the host's gemm then swiglu.
// On the H200 (264 / 396 block slots): 64 x 64 fuses with ks 1, 640 x 136 with ks 1 and a partial
// last chunk, 608 x 200 with ks 2 (K % 64 = 8), 1024 x 512 and 3072 x 1024 with ks 4; 64 x 100
// (K % 8 != 0) fuses with tiled weights only (element x loads); 608 x 136 and 40 x 64 (no fused
// tiling) fall back to the pair; 12288 x 1024 (ks 4, 768 column blocks) runs persistent when tiled and
// DFLASH_GEMM_PERSIST=3 (gpu_check.sh runs these cases again with it: persistence is off by default).
void test_gemm_swiglu() {
    Group g("gemm_swiglu");
    if (!g.enabled()) return;
    std::vector<int64_t> ms = {1, 7, 16, 17, 33};
    struct IK { int64_t inter, k; };
    std::vector<IK> iks = {{64, 64},    {640, 136}, {608, 200}, {1024, 512},
                           {3072, 1024}, {64, 100}, {608, 136}, {40, 64},
                           {12288, 1024}};  // tiled: 768 column blocks, persistent
    if (g_opt.level == QUICK) ms = {1, 16, 17};
    if (g_opt.level == SMOKE) {
        ms = {1, 16};
        iks = {{640, 136}, {40, 64}};
    }
    int idx = 0;
    for (int64_t m : ms)
        for (const IK &ik : iks)
            for (bool tiled : {false, true}) {
                const int64_t pad_x = (idx++ % 3 == 1) ? 8 : 0;
                g.run(cat("M=", m, " inter=", ik.inter, " K=", ik.k, pad_x ? " ldx=+8" : "", tiled ? " tiled" : ""),
                      [&](Case &c) {
                          const int64_t ldx = ik.k + pad_x, n = 2 * ik.inter;
                          GemmInputs in(c, m, ik.k, ldx, n, n, 0, tiled, size_t(m * ik.inter));
                          DeviceBuffer s_h = poisoned(*H, size_t(m * n) * act_size(*H));
                          DeviceBuffer s_c = poisoned(*C, size_t(m * n) * act_size(*C));
                          H->gemm_swiglu(in.x_h.get(), m, ldx, in.v_h, ik.inter, s_h.get(), in.y_h.get());
                          C->gemm_swiglu(in.x_c.get(), m, ldx, in.v_c, ik.inter, s_c.get(), in.y_c.get());
                          sync(*C);
                          const InPlaceRows out = in.outputs(m, ik.inter, ik.inter);
                          c.close("out", out.got, out.ref, kTolBf16);
                      });
            }
}

// Norms folded into GEMMs (GemmFuse, Backend::folds_norms) against the host's: the GEMM that norms its rows
// (x unnormed, at residual-stream scale), the one that accumulates into y (the residual add), both, and the
// fused SwiGLU that norms; row-major and tiled weights, one and several row tiles, the persistent launch
// (12288 x 1024 tiled, under DFLASH_GEMM_PERSIST=3), slices of one k chunk (K = 136: 3 chunks, the last
// partial). Then the ops' fallbacks, which the cuda backend composes from its unfused kernels: prefill rows (the wide GEMM, M = 100) and x the
// ring-fed kernel cannot stream (K % 8 != 0, row-major). Then fold_norm itself (bf16-rounded products).
void test_gemm_fused() {
    Group g("gemm_fused");
    if (!g.enabled()) return;
    struct Shape { int64_t m, n, k; bool swiglu; };  // swiglu: n is the intermediate size
    std::vector<Shape> shapes = {{1, 300, 136, false},    {7, 2056, 1024, false},  {16, 64, 4096, false},
                                 {17, 12288, 1024, false}, {16, 12288, 1024, false}, {1, 640, 136, true},
                                 {16, 1024, 512, true},    {17, 12288, 1024, true},  {100, 300, 136, false},
                                 {100, 640, 136, true},    {7, 300, 100, false}};
    if (g_opt.level <= QUICK)
        shapes = {{1, 300, 136, false}, {17, 12288, 1024, false}, {16, 1024, 512, true}, {100, 300, 136, false},
                  {7, 300, 100, false}};
    // parts: the norm's sums of squares given (ss_in, as the model passes them from the GEMM before), or not
    // (the backend norms x first); accumulate also asks for the new y's (ss_out, checked against y).
    struct Mode { bool norm, parts, accumulate; const char *name; };
    const Mode modes[] = {{true, true, false, "norm"},           {true, false, false, "norm without parts"},
                          {false, false, true, "accumulate"},    {true, true, true, "norm+accumulate"}};
    for (const Shape &sh : shapes)
        for (bool tiled : {false, true})
            for (const Mode &mode : modes) {
                if (sh.swiglu && mode.accumulate) continue;
                const bool wide = sh.m == 100;  // prefill rows: GemmRows::Wide (gemm_wide.cu's kWideMinRows is 48)
                g.run(cat(sh.swiglu ? "gemm_swiglu" : "gemm", " ", mode.name, " M=", sh.m, sh.swiglu ? " inter=" : " N=",
                          sh.n, " K=", sh.k, tiled ? " tiled" : "", wide ? " (wide: unfused)" : "",
                          sh.k % 8 ? " (K % 8: unfused when row-major)" : ""),
                      [&](Case &c) {
                          const int64_t m = sh.m, k = sh.k, w_rows = sh.swiglu ? 2 * sh.n : sh.n;
                          const int64_t out_cols = sh.n;
                          const std::vector<float> x = c.rng.bf16_normal(size_t(m * k), mode.norm ? 4.f : 1.f);
                          const std::vector<float> w = c.rng.bf16_normal(size_t(w_rows * k), 1.f / std::sqrt(float(k)));
                          const std::vector<float> y0 = c.rng.bf16_normal(size_t(m * out_cols), 2.f);
                          Weight w_h = upload_weight(*H, w, w_rows, k), w_c = upload_weight(*C, w, w_rows, k);
                          if (tiled) w_c = tiled_weight(*C, w_c);
                          DeviceBuffer x_h = upload_act(*H, x), x_c = upload_act(*C, x);
                          DeviceBuffer y_h = mode.accumulate ? upload_act(*H, y0) : poisoned(*H, y0.size() * act_size(*H));
                          DeviceBuffer y_c = mode.accumulate ? upload_act(*C, y0) : poisoned(*C, y0.size() * act_size(*C));
                          const GemmFuse fuse_h{mode.norm ? 1e-6f : 0.f, mode.accumulate};  // the host sums itself
                          GemmFuse fuse_c = fuse_h;
                          const std::vector<float> parts_in = sq_parts(x, m, k);
                          DeviceBuffer ss_in = upload_bytes(*C, parts_in.data(), parts_in.size() * sizeof(float));
                          const size_t n_out = size_t(m * ss_parts(out_cols));
                          DeviceBuffer ss_out = poisoned(*C, n_out * sizeof(float));
                          if (mode.parts) fuse_c.ss_in = ss_in.as<float>();
                          if (mode.accumulate) fuse_c.ss_out = ss_out.as<float>();
                          const GemmRows rows = wide ? GemmRows::Wide : GemmRows::Uniform;
                          if (sh.swiglu) {
                              DeviceBuffer s_h(H, size_t(m * w_rows) * act_size(*H));
                              DeviceBuffer s_c(C, size_t(m * w_rows) * act_size(*C));
                              H->gemm_swiglu(x_h.get(), m, k, w_h.view, sh.n, s_h.get(), y_h.get(), GemmRows::Uniform,
                                             fuse_h);
                              C->gemm_swiglu(x_c.get(), m, k, w_c.view, sh.n, s_c.get(), y_c.get(), rows, fuse_c);
                          } else {
                              H->gemm(x_h.get(), m, k, w_h.view, y_h.get(), out_cols, GemmRows::Uniform, fuse_h);
                              C->gemm(x_c.get(), m, k, w_c.view, y_c.get(), out_cols, rows, fuse_c);
                          }
                          sync(*C);
                          const std::vector<float> y_cuda = download_act(*C, y_c.get(), y0.size());
                          c.close("y", y_cuda, download_act(*H, y_h.get(), y0.size()), kTolBf16);
                          if (mode.accumulate)  // the sums of squares of what cuda stored, in fp32
                              c.close("ss_out", download_vec<float>(*C, ss_out.get(), n_out), sq_parts(y_cuda, m, out_cols),
                                      1e-5);
                      });
            }
    g.run("fold_norm [300, 136] and [64, 4096]", [&](Case &c) {
        for (int64_t n : {int64_t(300), int64_t(64)}) {
            const int64_t k = n == 300 ? 136 : 4096;
            const std::vector<float> w = c.rng.bf16_normal(size_t(n * k));
            std::vector<float> gv(static_cast<size_t>(k));
            for (auto &v : gv) v = round_bf16(1.f + c.rng.normal(0.3f));
            Weight w_h = upload_weight(*H, w, n, k), w_c = upload_weight(*C, w, n, k);
            Weight g_h = upload_weight(*H, gv, 1, k), g_c = upload_weight(*C, gv, 1, k);
            H->fold_norm(w_h.view, g_h.view);
            C->fold_norm(w_c.view, g_c.view);
            sync(*C);
            // The host keeps fp32 weights (w * g exact in fp32); cuda rounds each product to bf16 once.
            std::vector<float> ref = decode(H->weight_dtype(DFLASH_DTYPE_F32),
                                            download_bytes(*H, w_h.buf.get(), w_h.buf.bytes()));
            for (auto &v : ref) v = round_bf16(v);
            const std::vector<float> got = decode(w_c.view.dtype, download_bytes(*C, w_c.buf.get(), w_c.buf.bytes()));
            c.equal(cat("folded weight ", n, " x ", k).c_str(), got, ref);
        }
    });
}

// The wide GEMM (GemmRows::Wide: prefill chunks) and its fused SwiGLU against the host's gemm (and
// swiglu): rows past one 64-row tile and short of the next, N past a 128-column block, K short of a
// 64-wide step, padded strides, sliced and tiled weights, inter not a multiple of 64. Every case but
// the last two takes the wide kernel (checked: gemm_wide_fits); M = 40 (too few rows) and K = 100
// (K % 8 != 0, tiled) fall back to the small-M kernels.
void test_gemm_wide() {
    Group g("gemm_wide");
    if (!g.enabled()) return;
    struct Shape { int64_t m, n, k, pad_x, pad_y; bool swiglu, wide; };  // swiglu: n is the intermediate size
    std::vector<Shape> shapes = {
        {64, 128, 64, 0, 0, false, true},     {100, 300, 136, 8, 0, false, true},
        {256, 1000, 512, 0, 8, false, true},  {257, 136, 1000, 64, 0, false, true},
        {48, 2056, 1024, 0, 0, false, true},  {130, 64, 4096, 0, 0, false, true},
        {64, 64, 64, 0, 0, true, true},       {100, 640, 136, 8, 0, true, true},
        {257, 608, 200, 0, 0, true, true},    {256, 100, 512, 0, 0, true, true},
        {40, 300, 136, 0, 0, false, false},   {64, 64, 100, 0, 0, true, false}};
    if (g_opt.level <= QUICK)
        shapes = {{100, 300, 136, 8, 0, false, true}, {257, 608, 200, 0, 0, true, true},
                  {256, 100, 512, 0, 0, true, true}};
    int idx = 0;
    for (const Shape &sh : shapes)
        for (bool tiled : {false, true}) {
            if (!tiled && sh.k % 8 != 0) continue;  // row-major weights need 16-byte rows for either kernel's fused path
            const int64_t slice_first = !sh.swiglu && idx++ % 3 == 2 ? (tiled ? kTileRows : 5) : 0;
            g.run(cat(sh.swiglu ? "gemm_swiglu M=" : "gemm M=", sh.m, sh.swiglu ? " inter=" : " N=", sh.n, " K=", sh.k,
                      sh.pad_x ? cat(" ldx=+", sh.pad_x) : "", sh.pad_y ? cat(" ldy=+", sh.pad_y) : "",
                      slice_first ? cat(" rows from ", slice_first) : "", tiled ? " tiled" : "",
                      sh.wide ? "" : " (small-M kernel)"),
                  [&](Case &c) {
                      const int64_t m = sh.m, k = sh.k, ldx = k + sh.pad_x;
                      const int64_t out_cols = sh.n, w_rows = sh.swiglu ? 2 * sh.n : sh.n;
                      const int64_t ldy = out_cols + sh.pad_y, stored_rows = w_rows + slice_first + (sh.swiglu ? 0 : 3);
                      GemmInputs in(c, m, k, ldx, w_rows, stored_rows, slice_first, tiled, size_t(m * ldy));
                      const bool fits = cuda::gemm_wide_fits(static_cast<const __nv_bfloat16 *>(in.x_c.get()), m, ldx,
                                                             static_cast<const __nv_bfloat16 *>(in.v_c.data), tiled, k);
                      c.check(fits == sh.wide, cat("gemm_wide_fits says ", fits, ", the case expects ", sh.wide));
                      if (sh.swiglu) {  // the backend stores out at stride inter (pad_y is 0)
                          DeviceBuffer s_h(H, size_t(m * w_rows) * act_size(*H));
                          DeviceBuffer s_c(C, size_t(m * w_rows) * act_size(*C));
                          H->gemm_swiglu(in.x_h.get(), m, ldx, in.v_h, sh.n, s_h.get(), in.y_h.get());
                          C->gemm_swiglu(in.x_c.get(), m, ldx, in.v_c, sh.n, s_c.get(), in.y_c.get(), GemmRows::Wide);
                      } else {
                          H->gemm(in.x_h.get(), m, ldx, in.v_h, in.y_h.get(), ldy);
                          C->gemm(in.x_c.get(), m, ldx, in.v_c, in.y_c.get(), ldy, GemmRows::Wide);
                      }
                      sync(*C);
                      const InPlaceRows rows = in.outputs(m, sh.swiglu ? sh.n : ldy, out_cols);
                      c.close("y", rows.got, rows.ref, kTolBf16);
                      c.check(rows.pad_changed == 0,
                              cat(rows.pad_changed, " element(s) outside the output written"));
                  });
        }
}

// ----------------------------------------------------------------------------------------------
// rope
// ----------------------------------------------------------------------------------------------

void test_rope() {
    Group g("rope");
    if (!g.enabled()) return;
    struct Shape { int64_t rows, heads, head_dim, pad; float factor, theta; int32_t max_pos; };
    std::vector<Shape> shapes = {
        {1, 1, 64, 0, 1.f, 10000.f, 100},         {17, 8, 128, 2 * 2 * 128, 1.f, 1e6f, 4096},
        {97, 4, 64, 64, 1.2f, 10000.f, 40000},    {7, 32, 128, 0, 0.8f, 1e6f, 32768},
        {16, 2, 64, 2 * 64, 1.f, 500000.f, 131072}, {33, 8, 128, 8 * 128, 1.0986f, 1e6f, 200000}};
    if (g_opt.level == SMOKE) shapes = {{17, 8, 128, 2 * 2 * 128, 1.f, 1e6f, 4096},
                                        {97, 4, 64, 64, 1.2f, 10000.f, 40000}};
    for (const Shape &s : shapes)
        g.run(cat("rows=", s.rows, " heads=", s.heads, " head_dim=", s.head_dim, " ld=+", s.pad,
                  " attention_factor=", s.factor, " max_pos=", s.max_pos),
              [&](Case &c) {
                  const int64_t ld = s.heads * s.head_dim + s.pad, half = s.head_dim / 2;
                  const std::vector<float> x = c.rng.bf16_normal(size_t(s.rows * ld), 1.5f);
                  std::vector<int32_t> pos(size_t(s.rows));
                  for (auto &p : pos) p = int32_t(c.rng.index(s.max_pos));
                  pos[0] = 0;
                  std::vector<float> inv_freq(static_cast<size_t>(half));
                  for (int64_t i = 0; i < half; ++i) {
                      inv_freq[size_t(i)] = 1.f / std::pow(s.theta, float(2 * i) / float(s.head_dim));
                      if (s.factor != 1.f && i >= half / 2) inv_freq[size_t(i)] /= 8.f;  // a YaRN-like ramp
                  }
                  DeviceBuffer x_h = upload_act(*H, x), x_c = upload_act(*C, x);
                  DeviceBuffer p_h = upload_vec(*H, pos), p_c = upload_vec(*C, pos);
                  DeviceBuffer f_h = upload_vec(*H, inv_freq), f_c = upload_vec(*C, inv_freq);
                  H->rope(x_h.get(), s.rows, s.heads, s.head_dim, ld, p_h.as<int32_t>(),
                          f_h.as<float>(), s.factor);
                  C->rope(x_c.get(), s.rows, s.heads, s.head_dim, ld, p_c.as<int32_t>(),
                          f_c.as<float>(), s.factor);
                  sync(*C);
                  const size_t total = size_t(s.rows * ld);
                  const std::vector<float> all_h = download_act(*H, x_h.get(), total);
                  const std::vector<float> all_c = download_act(*C, x_c.get(), total);
                  const InPlaceRows rows = in_place_rows(all_c, all_h, x, s.rows, ld, s.heads * s.head_dim);
                  const int64_t pad_changed = rows.pad_changed;
                  c.close("x", rows.got, rows.ref, kTolBf16);
                  c.check(pad_changed == 0, cat(pad_changed, " element(s) outside the heads changed"));
              });
}

// ----------------------------------------------------------------------------------------------
// kv_write
// ----------------------------------------------------------------------------------------------

void test_kv_write() {
    Group g("kv_write");
    if (!g.enabled()) return;
    struct Shape { int64_t rows, kv_width, q_width, num_blocks; };
    // k and v sit inside a fused [q | k | v] row, as the engine writes them.
    std::vector<Shape> shapes = {{1, 64, 0, 2},   {17, 1024, 4096, 4},
                                 {97, 256, 1024, 9}, {16, 128, 0, 64}, {33, 512, 2048, 5}};
    if (g_opt.level == SMOKE) shapes = {{17, 1024, 4096, 4}};
    const int64_t bs = DFLASH_KV_BLOCK_SIZE;
    for (const Shape &s : shapes)
        g.run(cat("rows=", s.rows, " kv_width=", s.kv_width, " ld=", s.q_width + 2 * s.kv_width,
                  " blocks=", s.num_blocks),
              [&](Case &c) {
                  const int64_t ld = s.q_width + 2 * s.kv_width, slots_total = s.num_blocks * bs;
                  const std::vector<float> qkv = c.rng.bf16_normal(size_t(s.rows * ld));
                  std::vector<int32_t> all_slots(static_cast<size_t>(slots_total));
                  std::iota(all_slots.begin(), all_slots.end(), 0);
                  std::shuffle(all_slots.begin(), all_slots.end(), c.rng.gen);
                  std::vector<int32_t> slots(all_slots.begin(), all_slots.begin() + s.rows);
                  // The last third of the rows are padding (slot -1: not written), as a graphed propose pads.
                  for (int64_t r = s.rows - s.rows / 3; r < s.rows; ++r) slots[size_t(r)] = -1;
                  DeviceBuffer in_h = upload_act(*H, qkv), in_c = upload_act(*C, qkv);
                  DeviceBuffer sl_h = upload_vec(*H, slots), sl_c = upload_vec(*C, slots);
                  const size_t cache = size_t(slots_total * s.kv_width);
                  DeviceBuffer kc_h = poisoned(*H, cache * act_size(*H));
                  DeviceBuffer vc_h = poisoned(*H, cache * act_size(*H));
                  DeviceBuffer kc_c = poisoned(*C, cache * act_size(*C));
                  DeviceBuffer vc_c = poisoned(*C, cache * act_size(*C));
                  const char *base_h = static_cast<const char *>(in_h.get());
                  const char *base_c = static_cast<const char *>(in_c.get());
                  H->kv_write(base_h + s.q_width * act_size(*H),
                              base_h + (s.q_width + s.kv_width) * act_size(*H), s.rows, ld,
                              sl_h.as<int32_t>(), s.kv_width, kc_h.get(), vc_h.get());
                  C->kv_write(base_c + s.q_width * act_size(*C),
                              base_c + (s.q_width + s.kv_width) * act_size(*C), s.rows, ld,
                              sl_c.as<int32_t>(), s.kv_width, kc_c.get(), vc_c.get());
                  sync(*C);
                  std::vector<bool> written(size_t(slots_total), false);
                  for (int32_t sl : slots)
                      if (sl >= 0) written[size_t(sl)] = true;
                  for (int which = 0; which < 2; ++which) {
                      const DeviceBuffer &ch = which ? vc_h : kc_h;
                      const DeviceBuffer &cc = which ? vc_c : kc_c;
                      const std::vector<uint8_t> raw_c = download_bytes(*C, cc.get(), cache * act_size(*C));
                      const std::vector<float> all_c = decode(C->act_dtype(), raw_c);
                      const std::vector<float> all_h = download_act(*H, ch.get(), cache);
                      std::vector<float> got, ref;
                      int64_t stray = 0;
                      for (int64_t sl = 0; sl < slots_total; ++sl)
                          for (int64_t e = 0; e < s.kv_width; ++e) {
                              const size_t i = size_t(sl * s.kv_width + e);
                              if (written[size_t(sl)]) {
                                  got.push_back(all_c[i]);
                                  ref.push_back(all_h[i]);
                              } else if (!still_poisoned(raw_c, act_size(*C), i)) {
                                  ++stray;
                              }
                          }
                      c.equal(which ? "v_cache" : "k_cache", got, ref);  // a copy: exact
                      c.check(stray == 0, cat(which ? "v_cache: " : "k_cache: ", stray,
                                              " element(s) of unlisted slots written"));
                  }
              });
}

// The attention inputs' step: norm + rope of q and k heads in place, k and v into the caches, on
// the target's fused q/k/v rows (heads > 0) and the drafter's context K/V rows (heads = 0: kv
// only, inside a wider row; layers > 1: kv_norm_rope_write_layers over that many layers' [k | v] in
// the row, each with its own norm and caches). The host side is Backend's default (head_norm_rope
// twice, kv_write; once per layer).
void test_qkv_norm_rope_write() {
    Group g("qkv_norm_rope_write");
    if (!g.enabled()) return;
    struct Shape { int64_t rows, heads, kv_heads, head_dim; bool norm; int64_t num_blocks, layers = 1; };
    std::vector<Shape> shapes = {{1, 32, 8, 128, true, 2},     {16, 32, 8, 128, true, 4}, {17, 4, 1, 64, false, 3},
                                 {7, 8, 2, 256, true, 2},      {3, 3, 1, 20, true, 1},    {23, 0, 8, 128, true, 3},
                                 {16, 0, 8, 128, true, 3, 5},  {9, 0, 2, 64, false, 2, 18}};
    if (g_opt.level == SMOKE) shapes = {{16, 32, 8, 128, true, 4}};
    const int64_t bs = DFLASH_KV_BLOCK_SIZE;
    for (const Shape &s : shapes)
        g.run(cat("rows=", s.rows, " heads=", s.heads, "/", s.kv_heads, " head_dim=", s.head_dim,
                  s.norm ? "" : " no norm", s.layers > 1 ? cat(" layers=", s.layers) : std::string()),
              [&](Case &c) {
                  // heads = 0: the kv rows sit inside a wider row, as in the drafter's fused context K/V
                  const int64_t kv_width = s.kv_heads * s.head_dim, L = s.layers;
                  const int64_t q_width = s.heads ? s.heads * s.head_dim : 3 * kv_width;
                  const int64_t ld = q_width + 2 * kv_width * L;
                  const int64_t slots_total = s.num_blocks * bs;
                  const std::vector<float> qkv = c.rng.bf16_normal(size_t(s.rows * ld), 1.5f);
                  std::vector<float> wq(size_t(s.head_dim)), wk(size_t(s.head_dim * L));
                  for (auto &v : wq) v = round_bf16(1.f + c.rng.normal(0.2f));
                  for (auto &v : wk) v = round_bf16(1.f + c.rng.normal(0.2f));
                  const std::vector<int32_t> pos = random_positions(c.rng, s.rows, 40000);
                  const std::vector<float> inv_freq = rope_inv_freq(s.head_dim, 1e6f);
                  std::vector<int32_t> all_slots(static_cast<size_t>(slots_total));
                  std::iota(all_slots.begin(), all_slots.end(), 0);
                  std::shuffle(all_slots.begin(), all_slots.end(), c.rng.gen);
                  std::vector<int32_t> slots(all_slots.begin(), all_slots.begin() + s.rows);
                  // The last third of the rows are padding (slot -1: normed and rotated, not written).
                  for (int64_t r = s.rows - s.rows / 3; r < s.rows; ++r) slots[size_t(r)] = -1;
                  const size_t cache = size_t(slots_total * kv_width);
                  std::vector<float> x_out[2];
                  std::vector<std::vector<uint8_t>> caches[2];  // layer l's k cache at 2 l, its v cache at 2 l + 1
                  for (int b = 0; b < 2; ++b) {
                      Backend &be = b ? *C : *H;
                      Weight w_q = upload_weight(be, wq, 1, s.head_dim);
                      Weight w_k = upload_weight(be, wk, L, s.head_dim);
                      DeviceBuffer x = upload_act(be, qkv), p = upload_vec(be, pos), f = upload_vec(be, inv_freq);
                      DeviceBuffer sl = upload_vec(be, slots);
                      std::vector<DeviceBuffer> cb;
                      for (int64_t i = 0; i < 2 * L; ++i) cb.push_back(poisoned(be, cache * act_size(be)));
                      void *kv = static_cast<char *>(x.get()) + size_t(q_width) * act_size(be);
                      if (L == 1) {
                          be.qkv_norm_rope_write(s.heads ? x.get() : nullptr, ld, kv, ld, s.rows, s.heads,
                                                 s.kv_heads, s.head_dim, s.norm ? &w_q.view : nullptr,
                                                 s.norm ? &w_k.view : nullptr, 1e-6f, p.as<int32_t>(), f.as<float>(),
                                                 1.f, sl.as<int32_t>(), cb[0].get(), cb[1].get());
                      } else {  // heads = 0
                          std::vector<WeightView> norms;
                          std::vector<const WeightView *> norm_ptrs;
                          std::vector<void *> kc, vc;
                          for (int64_t l = 0; l < L; ++l) {
                              norms.push_back(w_k.view.slice_rows(l, 1));
                              kc.push_back(cb[size_t(2 * l)].get());
                              vc.push_back(cb[size_t(2 * l + 1)].get());
                          }
                          for (const WeightView &w : norms) norm_ptrs.push_back(&w);
                          be.kv_norm_rope_write_layers(kv, ld, 2 * kv_width, L, s.rows, s.kv_heads, s.head_dim,
                                                       s.norm ? norm_ptrs.data() : nullptr, 1e-6f, p.as<int32_t>(),
                                                       f.as<float>(), 1.f, sl.as<int32_t>(), kc.data(), vc.data());
                      }
                      sync(be);
                      x_out[b] = download_act(be, x.get(), size_t(s.rows * ld));
                      for (const DeviceBuffer &buf : cb)
                          caches[b].push_back(download_bytes(be, buf.get(), cache * act_size(be)));
                  }
                  c.close("qkv", x_out[1], x_out[0], kTolBf16);
                  std::vector<bool> written(size_t(slots_total), false);
                  for (int32_t sl : slots)
                      if (sl >= 0) written[size_t(sl)] = true;
                  for (size_t which = 0; which < size_t(2 * L); ++which) {
                      const std::string name = cat(which % 2 ? "v_cache" : "k_cache",
                                                   L > 1 ? cat(" of layer ", which / 2) : std::string());
                      const std::vector<float> all_h = decode(H->act_dtype(), caches[0][which]);
                      const std::vector<float> all_c = decode(C->act_dtype(), caches[1][which]);
                      std::vector<float> got, ref;
                      int64_t stray = 0;
                      for (int64_t sl = 0; sl < slots_total; ++sl)
                          for (int64_t e = 0; e < kv_width; ++e) {
                              const size_t i = size_t(sl * kv_width + e);
                              if (written[size_t(sl)]) {
                                  got.push_back(all_c[i]);
                                  ref.push_back(all_h[i]);
                              } else if (!still_poisoned(caches[1][which], act_size(*C), i)) {
                                  ++stray;
                              }
                          }
                      c.close(name.c_str(), got, ref, kTolBf16);
                      c.check(stray == 0, cat(name, ": ", stray, " element(s) of unlisted slots written"));
                  }
              });
}

// ----------------------------------------------------------------------------------------------
// attention
// ----------------------------------------------------------------------------------------------

enum MaskKind { MASK_NONE, MASK_CAUSAL, MASK_CAUSAL_WINDOW, MASK_WINDOW };
const char *mask_name(MaskKind m) {
    switch (m) {
        case MASK_NONE: return "none";
        case MASK_CAUSAL: return "causal";
        case MASK_CAUSAL_WINDOW: return "causal+window";
        case MASK_WINDOW: return "window";
    }
    return "?";
}

struct AttnShape {
    int64_t nq, ratio, n_kv, head_dim, num_keys;
    MaskKind mask;
    bool wrap;  // first_key > 0 and the keys wrap around the ring
    // > 0: a ring of this many slots at least (a deployment's capacity), the key count read from
    // device memory as graphs read it, so splits past the last key return at once
    int64_t capacity = 0;
    int64_t uniform_rows = 16;  // PagedKeys::uniform_rows (the engine's verify width); 0: the call's rows
    // >= 0: PagedKeys::fresh_keys (the cuda kernel stages the keys before the last `fresh` ahead of its
    // wait); with the count on the device, fresh_keys_device too. The rows-agree case: the call's rows.
    int64_t fresh = -1;
};

// Builds one paged cache on a backend: every slot the keys do not use holds NaN, so a kernel that
// reads outside [first_key, first_key + num_keys) or past a partly full last block fails.
struct PagedSetup {
    std::vector<float> k, v;               // [num_blocks * bs, kv_width], NaN where unused
    std::vector<int32_t> block_table;      // [ring_slots / bs]
    std::vector<int32_t> slot_positions;   // [ring_slots]
    std::vector<int32_t> q_positions;      // [nq]
    int64_t ring_slots = 0, first_key = 0, num_blocks = 0;
    AttentionMask mask;
};

PagedSetup make_paged(const AttnShape &s, Rng &rng) {
    const int64_t bs = DFLASH_KV_BLOCK_SIZE, kv_width = s.n_kv * s.head_dim;
    PagedSetup p;
    const int64_t ring_blocks = std::max(ceil_div(s.num_keys, bs) + (s.wrap ? 1 : 0), ceil_div(s.capacity, bs));
    p.ring_slots = ring_blocks * bs;
    // Wrapped: the first visible key sits in the second half of the ring, so the keys run past
    // its end and continue at ring slot 0; the partly full block is then in the middle.
    const int64_t start = s.wrap ? p.ring_slots - std::max<int64_t>(1, s.num_keys / 2) : 0;
    p.first_key = s.wrap ? 3 * p.ring_slots + start : 0;
    p.num_blocks = ring_blocks + 3;  // spare physical blocks nobody references
    std::vector<int32_t> phys(size_t(p.num_blocks));
    std::iota(phys.begin(), phys.end(), 0);
    std::shuffle(phys.begin(), phys.end(), rng.gen);
    p.block_table.assign(phys.begin(), phys.begin() + ring_blocks);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    p.k.assign(size_t(p.num_blocks * bs * kv_width), nan);
    p.v.assign(p.k.size(), nan);
    p.slot_positions.assign(size_t(p.ring_slots), -1000000);  // stale stamps outside the keys
    const int32_t pos0 = int32_t(p.first_key + 5);             // position = logical index + 5
    for (int64_t j = 0; j < s.num_keys; ++j) {
        const int64_t ring = (p.first_key + j) % p.ring_slots;
        const int64_t slot = int64_t(p.block_table[size_t(ring / bs)]) * bs + ring % bs;
        for (int64_t e = 0; e < kv_width; ++e) {
            p.k[size_t(slot * kv_width + e)] = round_bf16(rng.normal());
            p.v[size_t(slot * kv_width + e)] = round_bf16(rng.normal());
        }
        p.slot_positions[size_t(ring)] = pos0 + int32_t(j);
    }
    // Queries: the positions of the newest nq keys (a verify block / a drafter noise block);
    // with more queries than keys the extra ones repeat the newest position. Every query sees at
    // least the key at its own position, so no row is fully masked.
    for (int64_t i = 0; i < s.nq; ++i) {
        const int64_t j = std::min(std::max<int64_t>(0, s.num_keys - s.nq + i), s.num_keys - 1);
        p.q_positions.push_back(pos0 + int32_t(j));
    }
    const int32_t window = int32_t(std::max<int64_t>(2, std::min<int64_t>(s.num_keys / 3 + 1, 700)));
    p.mask.causal = s.mask == MASK_CAUSAL || s.mask == MASK_CAUSAL_WINDOW;
    p.mask.window = (s.mask == MASK_CAUSAL_WINDOW || s.mask == MASK_WINDOW) ? window : 0;
    return p;
}

// A PagedSetup's buffers on one backend, and PagedKeys over its first `count` keys (the count also
// in device memory, as graphs read it, when count_dev is given).
struct PagedBuffers {
    DeviceBuffer k, v, table, spos, qpos;
    PagedBuffers(Backend &be, const PagedSetup &p)
        : k(upload_act(be, p.k)), v(upload_act(be, p.v)), table(upload_vec(be, p.block_table)),
          spos(upload_vec(be, p.slot_positions)), qpos(upload_vec(be, p.q_positions)) {}
    PagedKeys keys(const PagedSetup &p, int64_t count, const int32_t *count_dev, int64_t uniform_rows,
                   int64_t fresh = -1, const int32_t *fresh_dev = nullptr) const {
        PagedKeys keys;
        keys.k_cache = k.get();
        keys.v_cache = v.get();
        keys.block_table = table.as<int32_t>();
        keys.slot_positions = spos.as<int32_t>();
        keys.block_size = DFLASH_KV_BLOCK_SIZE;
        keys.ring_slots = int32_t(p.ring_slots);
        keys.first_key = p.first_key;
        keys.num_keys = count;
        keys.num_keys_device = count_dev;
        keys.uniform_rows = uniform_rows;
        keys.fresh_keys = fresh;
        keys.fresh_keys_device = fresh >= 0 ? fresh_dev : nullptr;
        return keys;
    }
};

// An AttnShape's key count and fresh count uploaded to a backend, and PagedKeys over them (read on the device where
// the shape has a capacity, as graphs read them).
struct ShapeKeys {
    DeviceBuffer count_dev;
    PagedKeys keys;
    ShapeKeys(Backend &be, const PagedBuffers &bufs, const PagedSetup &p, const AttnShape &s)
        : count_dev(upload_vec(be, std::vector<int32_t>{int32_t(s.num_keys), int32_t(s.fresh)})) {
        const int32_t *count_ptr = s.capacity ? count_dev.as<int32_t>() : nullptr;
        keys = bufs.keys(p, s.num_keys, count_ptr, s.uniform_rows, s.fresh, count_ptr ? count_ptr + 1 : nullptr);
    }
};

std::string attn_desc(const AttnShape &s, const char *wrap) {
    return cat("nq=", s.nq, " heads=", s.ratio * s.n_kv, "/", s.n_kv, " head_dim=", s.head_dim, " keys=", s.num_keys,
               " mask=", mask_name(s.mask), s.wrap ? wrap : "",
               s.capacity ? cat(" capacity ", s.capacity, ", count on device") : "",
               s.fresh >= 0 ? cat(" fresh ", s.fresh) : "");
}

void run_attention_case(Group &g, const AttnShape &s) {
    g.run(attn_desc(s, " ring-wrap, q/k/v rows"),
          [&](Case &c) {
              const PagedSetup p = make_paged(s, c.rng);
              const int64_t n_heads = s.ratio * s.n_kv, q_width = n_heads * s.head_dim;
              // q rows at the target's fused q/k/v stride in the ring-wrap cases (k and v follow q)
              const int64_t ldq = q_width + (s.wrap ? 2 * s.n_kv * s.head_dim : 0);
              const std::vector<float> q = c.rng.bf16_normal(size_t(s.nq * ldq));
              const float scale = 1.f / std::sqrt(float(s.head_dim));
              const size_t out_count = size_t(s.nq * q_width);
              std::vector<float> outs[2];
              for (int b = 0; b < 2; ++b) {
                  Backend &be = b ? *C : *H;
                  const PagedBuffers bufs(be, p);
                  DeviceBuffer qb = upload_act(be, q);
                  DeviceBuffer out = poisoned(be, out_count * act_size(be));
                  const ShapeKeys sk(be, bufs, p, s);
                  be.attention(qb.get(), ldq, s.nq, bufs.qpos.as<int32_t>(), n_heads, s.n_kv, s.head_dim, scale,
                               p.mask, sk.keys, out.get());
                  sync(be);
                  outs[b] = download_act(be, out.get(), out_count);
              }
              c.close("out", outs[1], outs[0], kTolBf16);
          });
}

// The rows of a verify block against the same rows decoded alone (one query row, the keys up to
// its own position, the same cache): equal bit for bit (DESIGN §5: verify logits equal decode
// logits, which the lossless guarantee needs), wherever the row's keys fall in the splits. cuda only
// (the host reference plays no part).
void run_attention_rows_agree_case(Group &g, const AttnShape &s) {
    g.run("rows agree: " + attn_desc(s, " ring-wrap"),
          [&](Case &c) {
              const PagedSetup p = make_paged(s, c.rng);
              const int64_t n_heads = s.ratio * s.n_kv, q_width = n_heads * s.head_dim;
              const std::vector<float> q = c.rng.bf16_normal(size_t(s.nq * q_width));
              const float scale = 1.f / std::sqrt(float(s.head_dim));
              Backend &be = *C;
              const PagedBuffers bufs(be, p);
              DeviceBuffer qb = upload_act(be, q);
              // Rows [row0, row0 + rows) over the first `count` keys.
              auto run = [&](int64_t row0, int64_t rows, int64_t count) {
                  const int64_t fresh = s.fresh >= 0 ? rows : -1;  // as the target: the call's own rows
                  const std::vector<int32_t> counts = {int32_t(count), int32_t(fresh)};
                  DeviceBuffer count_dev = upload_vec(be, counts);
                  DeviceBuffer out = poisoned(be, size_t(rows * q_width) * act_size(be));
                  const int32_t *count_ptr = s.capacity ? count_dev.as<int32_t>() : nullptr;
                  const PagedKeys keys =
                      bufs.keys(p, count, count_ptr, s.uniform_rows, fresh, count_ptr ? count_ptr + 1 : nullptr);
                  const char *q_rows = static_cast<const char *>(qb.get()) + size_t(row0 * q_width) * act_size(be);
                  be.attention(q_rows, q_width, rows, bufs.qpos.as<int32_t>() + row0, n_heads, s.n_kv, s.head_dim,
                               scale, p.mask, keys, out.get());
                  sync(be);
                  return download_act(be, out.get(), size_t(rows * q_width));
              };
              const std::vector<float> block = run(0, s.nq, s.num_keys);
              for (int64_t i = 0; i < s.nq; ++i) {
                  const std::vector<float> alone = run(i, 1, s.num_keys - s.nq + i + 1);
                  const std::vector<float> in_block(block.begin() + i * q_width, block.begin() + (i + 1) * q_width);
                  c.equal(cat("row ", i, " decoded alone vs in the block").c_str(), alone, in_block);
              }
          });
}

// Backend::gemm_qkv_rope, then attention: a q/k/v GEMM of the rows (hidden size k), the attention inputs' step
// (qkv_norm_rope_write) and the attention, the call's rows the last keys. cuda against the host: out and the rows'
// cache slots close; the rope tail (CT: a cuda backend made with DFLASH_QKV_ROPE_TAIL=1, the step in the GEMM's
// epilogue where the launch takes it) against cuda's GEMM + rope kernel: bit for bit. The rows' slots start NaN,
// so an attention that reads them before the step wrote them fails.
Backend *CT = nullptr;  // cuda with the rope tail, or null (--self-test)
void run_qkv_rope_attention_case(Group &g, const AttnShape &s, bool norm, int64_t k) {
    g.run(cat("gemm_qkv_rope + attention: ", attn_desc(s, " ring-wrap"), " K=", k, norm ? "" : " no norm"),
          [&](Case &c) {
        PagedSetup p = make_paged(s, c.rng);
        const int64_t bs = DFLASH_KV_BLOCK_SIZE, n_heads = s.ratio * s.n_kv, hd = s.head_dim;
        const int64_t q_width = n_heads * hd, kv_width = s.n_kv * hd, ld = q_width + 2 * kv_width;
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::vector<int32_t> slots;  // the rows' (the last nq keys')
        for (int64_t r = 0; r < s.nq; ++r) {
            const int64_t ring = (p.first_key + s.num_keys - s.nq + r) % p.ring_slots;
            const int64_t slot = int64_t(p.block_table[size_t(ring / bs)]) * bs + ring % bs;
            slots.push_back(int32_t(slot));
            for (int64_t e = 0; e < kv_width; ++e) p.k[size_t(slot * kv_width + e)] = p.v[size_t(slot * kv_width + e)] = nan;
        }
        const std::vector<float> x = c.rng.bf16_normal(size_t(s.nq * k), 1.f);
        const std::vector<float> w = c.rng.bf16_normal(size_t(ld * k), 1.5f / std::sqrt(float(k)));
        std::vector<float> wq(static_cast<size_t>(hd)), wk(static_cast<size_t>(hd));
        for (auto &v : wq) v = round_bf16(1.f + c.rng.normal(0.2f));
        for (auto &v : wk) v = round_bf16(1.f + c.rng.normal(0.2f));
        const std::vector<float> inv_freq = rope_inv_freq(hd, 1e6f);
        const size_t out_count = size_t(s.nq * q_width), cache = p.k.size();
        struct Result {
            std::vector<uint8_t> out, k, v;
        };
        auto run = [&](Backend &be) {
            const PagedBuffers bufs(be, p);
            Weight w_q = upload_weight(be, wq, 1, hd), w_k = upload_weight(be, wk, 1, hd);
            Weight w_qkv = upload_weight(be, w, ld, k);
            if (is_cuda(be)) w_qkv = tiled_weight(be, w_qkv);  // as the cuda WeightStore keeps GEMM weights
            DeviceBuffer xb = upload_act(be, x), f = upload_vec(be, inv_freq), sl = upload_vec(be, slots);
            DeviceBuffer qkv = poisoned(be, size_t(s.nq * ld) * act_size(be));
            DeviceBuffer out = poisoned(be, out_count * act_size(be));
            const ShapeKeys sk(be, bufs, p, s);
            const PagedKeys &keys = sk.keys;
            void *kv = static_cast<char *>(qkv.get()) + size_t(q_width) * act_size(be);
            const Backend::RopeArgs args{qkv.get(), ld, kv, ld, norm ? &w_q.view : nullptr, norm ? &w_k.view : nullptr,
                                         1e-6f, bufs.qpos.as<int32_t>(), f.as<float>(), 1.f, sl.as<int32_t>()};
            be.gemm_qkv_rope(xb.get(), s.nq, k, w_qkv.view, GemmRows::Uniform, GemmFuse{}, args, n_heads, s.n_kv,
                             hd, bufs.k.get(), bufs.v.get());
            be.attention(qkv.get(), ld, s.nq, bufs.qpos.as<int32_t>(), n_heads, s.n_kv, hd, 1.f / std::sqrt(float(hd)),
                         p.mask, keys, out.get());
            sync(be);
            return Result{download_bytes(be, out.get(), out_count * act_size(be)),
                          download_bytes(be, bufs.k.get(), cache * act_size(be)),
                          download_bytes(be, bufs.v.get(), cache * act_size(be))};
        };
        const Result host = run(*H), got = run(*C);
        c.close("out", decode(C->act_dtype(), got.out), decode(H->act_dtype(), host.out), kTolBf16);
        std::vector<float> rows_c, rows_h;  // the rows' k and v slots
        for (const Result *r : {&got, &host}) {
            const Backend &be = r == &got ? *C : *H;
            const std::vector<float> kc = decode(be.act_dtype(), r->k), vc = decode(be.act_dtype(), r->v);
            std::vector<float> &dst = r == &got ? rows_c : rows_h;
            for (int32_t sl : slots)
                for (int64_t e = 0; e < kv_width; ++e) {
                    dst.push_back(kc[size_t(sl * kv_width + e)]);
                    dst.push_back(vc[size_t(sl * kv_width + e)]);
                }
        }
        c.close("the rows' k and v cache slots", rows_c, rows_h, kTolBf16);
        if (CT) {
            const Result tail = run(*CT);
            c.equal("out, the rope tail vs the rope kernel", tail.out, got.out);
            c.equal("the k cache, the rope tail vs the rope kernel", tail.k, got.k);
            c.equal("the v cache, the rope tail vs the rope kernel", tail.v, got.v);
        }
    });
}

void test_attention() {
    Group g("attention");
    if (!g.enabled()) return;
    const int64_t nqs[] = {1, 7, 16, 33}, ratios[] = {1, 4, 8}, hds[] = {64, 128};
    const MaskKind masks[] = {MASK_NONE, MASK_CAUSAL, MASK_CAUSAL_WINDOW, MASK_WINDOW};
    std::vector<int64_t> keys = {1, 17, 97, 1000, 5000};
    if (g_opt.level == QUICK) keys = {1, 17, 97, 300};
    if (g_opt.level == SMOKE) {
        run_attention_case(g, {16, 4, 2, 128, 97, MASK_NONE, true});
        run_attention_case(g, {7, 1, 2, 64, 17, MASK_CAUSAL, false});
        return;
    }
    // A large ring, few keys, the count on the device (as graphs read it): the splits past the
    // last key return at once. With 8 kv heads a split reads every 33rd chunk, so contexts of a
    // few thousand keys give each split several chunks (and partly masked ones).
    auto run_large_ring_cases = [&] {
        run_attention_case(g, {16, 4, 2, 128, 200, MASK_CAUSAL, false, 4096});
        run_attention_case(g, {9, 2, 2, 96, 700, MASK_CAUSAL, false, 8192});  // the non-tensor-core kernel
        run_attention_case(g, {16, 4, 8, 128, 5000, MASK_CAUSAL, false, 32768});   // 79 chunks, 33 splits
        run_attention_case(g, {9, 2, 8, 96, 3000, MASK_CAUSAL, true, 8192});       // 94 chunks of 32, 33 splits
        if (g_opt.level < DEFAULT) return;
        run_attention_case(g, {16, 4, 2, 128, 1040, MASK_CAUSAL, false, 32768});
        run_attention_case(g, {1, 4, 2, 128, 97, MASK_CAUSAL, true, 32768});
        run_attention_case(g, {7, 2, 2, 64, 300, MASK_CAUSAL_WINDOW, false, 20000});
        run_attention_case(g, {33, 4, 2, 64, 3000, MASK_CAUSAL, false, 65536, 64});  // wide uniform_rows
        run_attention_case(g, {16, 8, 8, 64, 4100, MASK_CAUSAL_WINDOW, true, 16384});  // 2 query tiles, windowed
        run_attention_case(g, {33, 4, 2, 128, 2000, MASK_CAUSAL, false, 32768, 0});  // default splits
        run_attention_case(g, {96, 2, 2, 256, 500, MASK_CAUSAL, false, 8192});       // wider than uniform_rows
    };
    if (g_opt.level == FULL) {
        run_large_ring_cases();
        for (int64_t nk : keys)
            for (MaskKind m : masks)
                for (int64_t nq : nqs)
                    for (int64_t r : ratios)
                        for (int64_t hd : hds)
                            for (bool wrap : {false, true})
                                run_attention_case(g, {nq, r, 2, hd, nk, m, wrap});
        return;
    }
    // A covering walk: every (keys, mask, head_dim) triple once, with nq, GQA ratio and wrap
    // cycling at co-prime strides so each value meets each other value several times.
    int idx = 0;
    for (int64_t nk : keys)
        for (MaskKind m : masks)
            for (int64_t hd : hds) {
                const AttnShape s{nqs[(idx + idx / 8) % 4], ratios[idx % 3], 2, hd, nk, m,
                                  (idx / 2 + idx / 3) % 2 == 1};
                ++idx;
                run_attention_case(g, s);
            }
    if (g_opt.level >= DEFAULT) {  // Qwen3-8B-like head layout: 32 query heads over 8 KV heads
        run_attention_case(g, {16, 4, 8, 128, 1000, MASK_NONE, true});
        run_attention_case(g, {16, 4, 8, 128, 5000, MASK_CAUSAL, false});
    }
    run_large_ring_cases();
    // Settled keys staged before the kernel's wait (PagedKeys::fresh_keys): the target's steps (fresh = its
    // rows; the count and the fresh count on the device), a wrapped window, fresh keys partly inside chunk 0,
    // every key fresh.
    run_attention_case(g, {16, 4, 8, 128, 1000, MASK_CAUSAL, false, 0, 16, 16});
    run_attention_case(g, {1, 4, 8, 128, 1025, MASK_CAUSAL, false, 32768, 16, 1});
    run_attention_case(g, {7, 2, 2, 64, 300, MASK_CAUSAL_WINDOW, true, 0, 16, 7});
    run_attention_case(g, {16, 4, 2, 128, 40, MASK_CAUSAL, false, 0, 16, 16});
    run_attention_case(g, {5, 4, 2, 128, 5, MASK_CAUSAL, false, 4096, 16, 5});
    run_attention_case(g, {16, 4, 8, 128, 3000, MASK_NONE, true, 8192, 16, 23});
    // Verify rows == decode rows, bit for bit: the tensor-core kernel (head_dim 128 and 64, one and
    // two query tiles per block), the other kernel, several chunks per split, the count on the
    // device or not, a window, a wrapped ring.
    run_attention_rows_agree_case(g, {16, 4, 8, 128, 5000, MASK_CAUSAL, false, 32768});
    run_attention_rows_agree_case(g, {16, 8, 8, 64, 3000, MASK_CAUSAL, false});
    run_attention_rows_agree_case(g, {16, 2, 8, 96, 3000, MASK_CAUSAL_WINDOW, true, 8192});
    run_attention_rows_agree_case(g, {3, 4, 2, 128, 1040, MASK_CAUSAL, false, 32768});
    run_attention_rows_agree_case(g, {16, 4, 8, 128, 1040, MASK_CAUSAL, false, 32768, 16, 0});  // fresh: the rows
    if (g_opt.level >= DEFAULT) run_attention_rows_agree_case(g, {16, 4, 8, 128, 20000, MASK_CAUSAL, true, 32768});
    // gemm_qkv_rope + attention: a verify step and a decode step at Qwen3-8B shapes (the counts on the device), a
    // propose at the 4B drafter's hidden size (pending context rows fresh in the cache before the block's own),
    // head_dim 64 wrapped and windowed without norms, the rows' keys across two chunks without a fresh count, every
    // key the rows' own, rows over several query tiles (no rope tail: one row tile only), and a GEMM whose column
    // blocks hold two heads each.
    run_qkv_rope_attention_case(g, {16, 4, 8, 128, 1040, MASK_CAUSAL, false, 32768, 16, 16}, true, 4096);
    run_qkv_rope_attention_case(g, {1, 4, 8, 128, 1025, MASK_CAUSAL, false, 32768, 16, 1}, true, 4096);
    run_qkv_rope_attention_case(g, {16, 4, 8, 128, 1031, MASK_NONE, false, 0, 16, 23}, true, 2560);
    run_qkv_rope_attention_case(g, {7, 2, 2, 64, 300, MASK_CAUSAL_WINDOW, true, 0, 16, 7}, false, 512);
    run_qkv_rope_attention_case(g, {16, 4, 2, 128, 70, MASK_CAUSAL, false}, true, 256);
    run_qkv_rope_attention_case(g, {16, 4, 2, 128, 16, MASK_NONE, false, 0, 16, 16}, true, 1024);
    run_qkv_rope_attention_case(g, {33, 4, 2, 64, 300, MASK_CAUSAL, false, 0, 64, 33}, false, 512);
    run_qkv_rope_attention_case(g, {12, 8, 1, 64, 100, MASK_CAUSAL, false}, true, 64);
}

// ----------------------------------------------------------------------------------------------
// add, swiglu, copy_rows
// ----------------------------------------------------------------------------------------------

void test_add() {
    Group g("add");
    if (!g.enabled()) return;
    std::vector<int64_t> ns = {1, 17, 136, 97 * 1024, 16 * 4096 + 8};
    if (g_opt.level == SMOKE) ns = {17, 4096};
    for (int64_t n : ns)
        g.run(cat("n=", n), [&](Case &c) {
            const std::vector<float> y = c.rng.bf16_normal(size_t(n)), x = c.rng.bf16_normal(size_t(n));
            DeviceBuffer y_h = upload_act(*H, y), y_c = upload_act(*C, y);
            DeviceBuffer x_h = upload_act(*H, x), x_c = upload_act(*C, x);
            H->add(y_h.get(), x_h.get(), n);
            C->add(y_c.get(), x_c.get(), n);
            sync(*C);
            c.close("y", download_act(*C, y_c.get(), size_t(n)), download_act(*H, y_h.get(), size_t(n)),
                    kTolBf16);
        });
}

void test_swiglu() {
    Group g("swiglu");
    if (!g.enabled()) return;
    std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 64}, {17, 136}, {97, 3072}, {16, 12288}};
    if (g_opt.level == SMOKE) shapes = {{17, 136}};
    for (auto [rows, inter] : shapes)
        g.run(cat("rows=", rows, " inter=", inter), [&, rows = rows, inter = inter](Case &c) {
            const std::vector<float> gu = c.rng.bf16_normal(size_t(rows * 2 * inter), 2.f);
            DeviceBuffer in_h = upload_act(*H, gu), in_c = upload_act(*C, gu);
            const size_t count = size_t(rows * inter);
            DeviceBuffer out_h = poisoned(*H, count * act_size(*H));
            DeviceBuffer out_c = poisoned(*C, count * act_size(*C));
            H->swiglu(in_h.get(), rows, inter, out_h.get());
            C->swiglu(in_c.get(), rows, inter, out_c.get());
            sync(*C);
            c.close("out", download_act(*C, out_c.get(), count), download_act(*H, out_h.get(), count),
                    kTolBf16);
        });
}

void test_copy_rows() {
    Group g("copy_rows");
    if (!g.enabled()) return;
    struct Shape { int64_t rows, width, ld_src, ld_dst; };
    std::vector<Shape> shapes = {{1, 64, 64, 64}, {17, 1024, 1088, 1024}, {97, 128, 384, 256},
                                 {16, 4096, 4096, 8192}};
    if (g_opt.level == SMOKE) shapes = {{97, 128, 384, 256}};
    for (const Shape &s : shapes)
        g.run(cat("rows=", s.rows, " width=", s.width, " ld_src=", s.ld_src, " ld_dst=", s.ld_dst),
              [&](Case &c) {
                  const std::vector<float> src = c.rng.bf16_normal(size_t(s.rows * s.ld_src));
                  DeviceBuffer s_h = upload_act(*H, src), s_c = upload_act(*C, src);
                  const size_t total = size_t(s.rows * s.ld_dst);
                  DeviceBuffer d_h = poisoned(*H, total * act_size(*H));
                  DeviceBuffer d_c = poisoned(*C, total * act_size(*C));
                  H->copy_rows(s_h.get(), s.ld_src, s.rows, s.width, d_h.get(), s.ld_dst);
                  C->copy_rows(s_c.get(), s.ld_src, s.rows, s.width, d_c.get(), s.ld_dst);
                  sync(*C);
                  const std::vector<uint8_t> raw_c = download_bytes(*C, d_c.get(), total * act_size(*C));
                  const std::vector<float> all_c = decode(C->act_dtype(), raw_c);
                  const std::vector<float> all_h = download_act(*H, d_h.get(), total);
                  std::vector<float> got, ref;
                  int64_t stray = 0;
                  for (int64_t r = 0; r < s.rows; ++r)
                      for (int64_t col = 0; col < s.ld_dst; ++col) {
                          const size_t i = size_t(r * s.ld_dst + col);
                          if (col < s.width) {
                              got.push_back(all_c[i]);
                              ref.push_back(all_h[i]);
                          } else if (!still_poisoned(raw_c, act_size(*C), i)) {
                              ++stray;
                          }
                      }
                  c.equal("dst", got, ref);
                  c.check(stray == 0, cat(stray, " padding element(s) written"));
              });
}

// ----------------------------------------------------------------------------------------------
// logits, logits_argmax
// ----------------------------------------------------------------------------------------------

struct LogitShape { int64_t m, vocab, hidden; float multiplier, softcap; };

std::vector<LogitShape> logit_shapes() {
    if (g_opt.level == SMOKE) return {{3, 1000, 256, 1.f, 0.f}, {2, 151936, 64, 0.7f, 30.f}};
    std::vector<LogitShape> s = {{1, 1000, 64, 1.f, 0.f},      {2, 1000, 256, 0.7f, 0.f},
                                 {7, 1000, 1024, 1.f, 30.f},   {16, 1000, 4096, 0.5f, 0.f},
                                 {1, 151936, 256, 1.f, 0.f},   {5, 151936, 128, 1.f, 30.f},
                                 {33, 1000, 256, 1.f, 0.f}};  // three row tiles (argmax partials of m0 > 0)
    if (g_opt.level >= DEFAULT) {
        s.push_back({16, 151936, 256, 0.8f, 0.f});
        s.push_back({1, 8192, 4096, 1.f, 0.f});
        s.push_back({9, 151937, 64, 1.f, 50.f});  // an odd vocab
    }
    return s;
}

struct LogitInputs {
    std::vector<float> h, w;
};

LogitInputs make_logit_inputs(const LogitShape &s, Rng &rng) {
    LogitInputs in;
    in.h = rng.bf16_normal(size_t(s.m * s.hidden));
    in.w = rng.bf16_normal(size_t(s.vocab * s.hidden), 3.f / std::sqrt(float(s.hidden)));
    return in;
}

void test_logits() {
    Group g("logits");
    if (!g.enabled()) return;
    for (const LogitShape &s : logit_shapes())
      for (bool tiled : {false, true})
        g.run(cat("M=", s.m, " vocab=", s.vocab, " H=", s.hidden, " mult=", s.multiplier,
                  " softcap=", s.softcap, tiled ? " tiled" : ""),
              [&](Case &c) {
                  const LogitInputs in = make_logit_inputs(s, c.rng);
                  const size_t count = size_t(s.m * s.vocab);
                  std::vector<float> outs[2];
                  for (int b = 0; b < 2; ++b) {
                      Backend &be = b ? *C : *H;
                      Weight w = upload_weight(be, in.w, s.vocab, s.hidden);
                      if (b && tiled) w = tiled_weight(be, w);
                      DeviceBuffer h = upload_act(be, in.h);
                      DeviceBuffer out = poisoned(be, count * 4);
                      be.logits(h.get(), s.m, w.view, s.multiplier, s.softcap, out.as<float>());
                      sync(be);
                      outs[b] = download_vec<float>(be, out.get(), count);
                  }
                  c.close("logits", outs[1], outs[0], kTolF32FromBf16);
              });
}

void test_logits_argmax() {
    Group g("logits_argmax");
    if (!g.enabled()) return;
    for (const LogitShape &s : logit_shapes())
      for (bool tiled : {false, true})
        g.run(cat("M=", s.m, " vocab=", s.vocab, " H=", s.hidden, " mult=", s.multiplier,
                  " softcap=", s.softcap, tiled ? " tiled" : ""),
              [&](Case &c) {
                  const LogitInputs in = make_logit_inputs(s, c.rng);
                  // Host: full logits (for the margins) and its own argmax.
                  Weight w_h = upload_weight(*H, in.w, s.vocab, s.hidden);
                  DeviceBuffer h_h = upload_act(*H, in.h);
                  std::vector<float> logits(size_t(s.m * s.vocab));
                  H->logits(h_h.get(), s.m, w_h.view, s.multiplier, s.softcap, logits.data());
                  DeviceBuffer t_h = poisoned(*H, size_t(s.m) * 4);
                  H->logits_argmax(h_h.get(), s.m, w_h.view, s.multiplier, s.softcap, t_h.as<int32_t>());
                  const std::vector<int32_t> ref = download_vec<int32_t>(*H, t_h.get(), size_t(s.m));
                  Weight w_c = upload_weight(*C, in.w, s.vocab, s.hidden);
                  if (tiled) w_c = tiled_weight(*C, w_c);
                  DeviceBuffer h_c = upload_act(*C, in.h);
                  DeviceBuffer t_c = poisoned(*C, size_t(s.m) * 4);
                  C->logits_argmax(h_c.get(), s.m, w_c.view, s.multiplier, s.softcap, t_c.as<int32_t>());
                  sync(*C);
                  const std::vector<int32_t> got = download_vec<int32_t>(*C, t_c.get(), size_t(s.m));
                  for (int64_t i = 0; i < s.m; ++i) {
                      const float *row = logits.data() + i * s.vocab;
                      const float best = row[ref[size_t(i)]];
                      // bf16 has 8 significant bits: a token within 2^-8 relative of the best
                      // may legitimately win on the GPU.
                      const float err = 4e-3f * std::max(1.f, std::fabs(best));
                      const int32_t t = got[size_t(i)];
                      if (t == ref[size_t(i)]) continue;
                      if (t < 0 || t >= s.vocab) {
                          c.problem(cat("row ", i, ": token ", t, " out of range (unwritten?)"));
                      } else if (row[t] >= best - err) {
                          c.boundary();  // a near tie: the host's top-2 margin is below the error
                      } else {
                          c.problem(cat("row ", i, ": cuda token ", t, " (host logit ", row[t],
                                        ") != host argmax ", ref[size_t(i)], " (", best, "), margin ",
                                        best - row[t], " > error ", err));
                      }
                  }
              });
}

// ----------------------------------------------------------------------------------------------
// sampling: sampling_probs, sample_rows, greedy_accept, rejection_accept
// ----------------------------------------------------------------------------------------------

// A row of logits: "flat" (all N(0, 1)) or "spiky" (N(0, 1) plus 40 tokens raised to 10..22,
// well apart, so top-k and top-p cut between clearly separated probabilities).
std::vector<float> logit_row(Rng &rng, int64_t vocab, bool spiky) {
    std::vector<float> row(static_cast<size_t>(vocab));
    for (auto &v : row) v = rng.normal();
    if (spiky) {
        const int64_t n = std::min<int64_t>(40, vocab);
        for (int64_t j = 0; j < n; ++j) row[size_t(rng.index(vocab))] = 10.f + 0.3f * float(j) + rng.uniform(0.f, 0.1f);
    }
    return row;
}

// True if the host's top-p cut of this row is within `margin` of a boundary (a different but
// equally right summation order could keep one token more or less).
bool top_p_ambiguous(const std::vector<float> &logits, float temperature, float top_p, int32_t top_k,
                     double margin) {
    if (top_p >= 1.f) return false;
    std::vector<float> s(logits);
    for (auto &v : s) v /= temperature;
    std::sort(s.begin(), s.end(), std::greater<float>());
    const size_t kept = (top_k > 0 && size_t(top_k) < s.size()) ? size_t(top_k) : s.size();
    double total = 0;
    for (size_t r = 0; r < kept; ++r) total += std::exp(double(s[r]) - s[0]);
    double cumulative = 0;
    for (size_t r = 0; r < kept; ++r) {
        if (std::fabs(cumulative - top_p) < margin) return true;
        cumulative += std::exp(double(s[r]) - s[0]) / total;
    }
    return false;
}

struct ProbShape { int64_t m, vocab; float temperature, top_p; int32_t top_k; bool spiky; };

std::vector<ProbShape> prob_shapes() {
    if (g_opt.level == SMOKE) return {{4, 1000, 0.7f, 0.9f, 0, true}, {2, 151936, 1.f, 0.95f, 40, true}};
    std::vector<ProbShape> s = {
        {1, 1000, 1.f, 1.f, 0, false},      {4, 1000, 0.7f, 0.9f, 0, true},
        {7, 1000, 1.f, 1.f, 20, true},      {16, 1000, 1.3f, 0.5f, 50, true},
        {2, 1000, 1.f, 0.01f, 0, true},     {2, 151936, 1.f, 1.f, 0, false},
        {3, 151936, 0.6f, 0.9f, 0, true},   {5, 151936, 1.f, 0.95f, 40, true},
        {1, 151936, 1.f, 1.f, 1, true}};
    if (g_opt.level >= DEFAULT) {
        s.push_back({16, 151936, 0.8f, 0.8f, 100, true});
        s.push_back({16, 151936, 1.f, 1.f, 0, true});
        s.push_back({3, 1000, 1.f, 1.f, 1000, false});  // top_k == vocab: keep all
    }
    return s;
}

// m rows of logits whose top-p cut is clear of boundaries.
std::vector<float> prob_inputs(const ProbShape &s, Rng &rng) {
    std::vector<float> rows;
    for (int64_t i = 0; i < s.m; ++i) {
        std::vector<float> row;
        for (int attempt = 0; attempt < 20; ++attempt) {
            row = logit_row(rng, s.vocab, s.spiky);
            if (!top_p_ambiguous(row, s.temperature, s.top_p, s.top_k, 1e-4)) break;
        }
        rows.insert(rows.end(), row.begin(), row.end());
    }
    return rows;
}

void test_sampling_probs() {
    Group g("sampling_probs");
    if (!g.enabled()) return;
    for (const ProbShape &s : prob_shapes())
        g.run(cat("M=", s.m, " vocab=", s.vocab, " T=", s.temperature, " top_p=", s.top_p,
                  " top_k=", s.top_k, s.spiky ? " spiky" : " flat"),
              [&](Case &c) {
                  const std::vector<float> logits = prob_inputs(s, c.rng);
                  std::vector<float> outs[2];
                  for (int b = 0; b < 2; ++b) {
                      Backend &be = b ? *C : *H;
                      DeviceBuffer rows = upload_vec(be, logits);
                      be.sampling_probs(rows.as<float>(), s.m, s.vocab, s.temperature, s.top_p, s.top_k);
                      sync(be);
                      outs[b] = download_vec<float>(be, rows.get(), logits.size());
                  }
                  c.close("probs", outs[1], outs[0], kTolF32);
                  int64_t support = 0;
                  for (size_t i = 0; i < logits.size(); ++i)
                      support += (outs[0][i] > 0.f) != (outs[1][i] > 0.f);
                  c.check(support == 0, cat(support, " token(s) kept by one backend and dropped by the other"));
              });
}

// The tokens an inverse-CDF draw with uniform u may return from `probs`, allowing for a
// different (fp32) summation order: those whose CDF interval, widened by `slack`, holds u*total.
bool draw_consistent(const float *probs, int64_t vocab, float u, int32_t token, double slack) {
    if (token < 0 || token >= vocab || !(probs[token] > 0.f)) return false;
    double total = 0;
    for (int64_t v = 0; v < vocab; ++v) total += probs[v];
    double before = 0;
    for (int64_t v = 0; v < token; ++v) before += probs[v];
    const double target = double(u) * total, eps = slack * total;
    return before - eps <= target && target < before + probs[token] + eps;
}

// Host draw (the reference's inverse CDF), used to build draft tokens.
int32_t host_draw(const std::vector<float> &probs, size_t offset, int64_t vocab, Rng &rng) {
    double total = 0;
    for (int64_t v = 0; v < vocab; ++v) total += probs[offset + size_t(v)];
    double target = rng.uniform(0.f, 1.f) * total, cumulative = 0;
    for (int64_t v = 0; v < vocab; ++v) {
        cumulative += probs[offset + size_t(v)];
        if (cumulative > target && probs[offset + size_t(v)] > 0) return int32_t(v);
    }
    return int32_t(vocab - 1);
}

// Probabilities of m rows, computed by the host's sampling_probs.
std::vector<float> host_probs(const ProbShape &s, Rng &rng) {
    std::vector<float> rows = prob_inputs(s, rng);
    H->sampling_probs(rows.data(), s.m, s.vocab, s.temperature, s.top_p, s.top_k);
    return rows;
}

constexpr double kCdfSlack = 2e-5;  // fp32 prefix sums over up to ~150k terms

void test_sample_rows() {
    Group g("sample_rows");
    if (!g.enabled()) return;
    for (const ProbShape &s : prob_shapes())
        for (int rep = 0; rep < (g_opt.level == SMOKE ? 1 : 3); ++rep)
            g.run(cat("M=", s.m, " vocab=", s.vocab, " T=", s.temperature, " top_p=", s.top_p,
                      " top_k=", s.top_k, s.spiky ? " spiky" : " flat", " rep ", rep),
                  [&](Case &c) {
                      const std::vector<float> probs = host_probs(s, c.rng);
                      RngKey key{c.rng.bits(), c.rng.bits() & 0xFFFFFFFFFFull};
                      const uint32_t first_row = uint32_t(c.rng.index(1000));
                      const uint32_t purpose = rep % 2 ? RNG_SAMPLE : RNG_DRAFT;
                      std::vector<int32_t> outs[2];
                      for (int b = 0; b < 2; ++b) {
                          Backend &be = b ? *C : *H;
                          DeviceBuffer p = upload_vec(be, probs);
                          DeviceBuffer out = poisoned(be, size_t(s.m) * 4);
                          be.sample_rows(p.as<float>(), s.m, s.vocab, key, first_row, purpose,
                                         out.as<int32_t>());
                          sync(be);
                          outs[b] = download_vec<int32_t>(be, out.get(), size_t(s.m));
                      }
                      for (int64_t i = 0; i < s.m; ++i) {
                          const int32_t t = outs[1][size_t(i)], ref = outs[0][size_t(i)];
                          if (t == ref) continue;
                          const float u = rng_uniform(key, first_row + uint32_t(i), purpose);
                          if (draw_consistent(probs.data() + i * s.vocab, s.vocab, u, t, kCdfSlack))
                              c.boundary();
                          else
                              c.problem(cat("row ", i, ": cuda drew ", t, ", host ", ref, ", u=", u,
                                            " and the CDF does not allow ", t));
                      }
                  });
}

void test_greedy_accept() {
    Group g("greedy_accept");
    if (!g.enabled()) return;
    const int reps = g_opt.level == SMOKE ? 2 : 6;
    for (int64_t n : {1, 2, 5, 16})
        for (int rep = 0; rep < reps; ++rep)
            g.run(cat("n=", n, " rep ", rep), [&](Case &c) {
                const int64_t accept = c.rng.index(n);  // 0..n-1 drafts match
                std::vector<int32_t> tokens(static_cast<size_t>(n)), posterior(static_cast<size_t>(n));
                for (auto &p : posterior) p = int32_t(c.rng.index(151936));
                tokens[0] = int32_t(c.rng.index(151936));
                for (int64_t j = 1; j < n; ++j)
                    tokens[size_t(j)] = j <= accept ? posterior[size_t(j - 1)]
                                                    : int32_t(c.rng.index(151936));
                if (accept + 1 < n) tokens[size_t(accept + 1)] = posterior[size_t(accept)] ^ 1;
                std::vector<int32_t> outs[2];
                for (int b = 0; b < 2; ++b) {
                    Backend &be = b ? *C : *H;
                    DeviceBuffer t = upload_vec(be, tokens), p = upload_vec(be, posterior);
                    DeviceBuffer out = poisoned(be, 8);
                    be.greedy_accept(t.as<int32_t>(), p.as<int32_t>(), n, out.as<int32_t>());
                    sync(be);
                    outs[b] = download_vec<int32_t>(be, out.get(), 2);
                }
                c.check(outs[0][0] == accept, cat("test bug: host accepted ", outs[0][0], " not ", accept));
                c.equal("[accepted, next]", outs[1], outs[0]);
            });
}

void test_rejection_accept() {
    Group g("rejection_accept");
    if (!g.enabled()) return;
    struct Shape { int64_t n, vocab; bool with_q; };
    std::vector<Shape> shapes = {{1, 1000, true},  {2, 1000, true},    {8, 1000, true},
                                 {16, 1000, true}, {16, 1000, false},  {4, 1000, false},
                                 {8, 151936, true}, {16, 151936, false}};
    if (g_opt.level == SMOKE) shapes = {{8, 1000, true}, {16, 1000, false}};
    const int reps = g_opt.level == SMOKE ? 1 : g_opt.level == QUICK ? 2 : 5;
    for (const Shape &s : shapes)
        for (int rep = 0; rep < reps; ++rep)
            g.run(cat("n=", s.n, " vocab=", s.vocab, s.with_q ? " q" : " q=one-hot", " rep ", rep),
                  [&](Case &c) {
                      // p: the target's rows; q: the drafter's, correlated with p so that drafts
                      // are accepted some of the time but not always.
                      const ProbShape ps{s.n, s.vocab, 1.f, 1.f, 0, true};
                      std::vector<float> logits = prob_inputs(ps, c.rng);
                      std::vector<float> p(logits), q(logits);
                      for (auto &v : q) v += c.rng.normal(1.5f);
                      H->sampling_probs(p.data(), s.n, s.vocab, 1.f, 1.f, 0);
                      H->sampling_probs(q.data(), s.n, s.vocab, 0.8f, 1.f, 0);
                      q.resize(size_t((s.n - 1) * s.vocab));
                      std::vector<int32_t> tokens(size_t(s.n));
                      tokens[0] = int32_t(c.rng.index(s.vocab));
                      for (int64_t j = 1; j < s.n; ++j)
                          tokens[size_t(j)] = host_draw(s.with_q ? q : p, size_t((j - 1) * s.vocab),
                                                        s.vocab, c.rng);
                      const RngKey key{c.rng.bits(), c.rng.bits() & 0xFFFFFFFFull};
                      std::vector<int32_t> outs[2];
                      for (int b = 0; b < 2; ++b) {
                          Backend &be = b ? *C : *H;
                          DeviceBuffer pb = upload_vec(be, p), tb = upload_vec(be, tokens);
                          DeviceBuffer qb;
                          if (s.with_q && !q.empty()) qb = upload_vec(be, q);
                          DeviceBuffer out = poisoned(be, 8);
                          be.rejection_accept(pb.as<float>(), tb.as<int32_t>(),
                                              s.with_q ? qb.as<float>() : nullptr, s.n, s.vocab, key,
                                              out.as<int32_t>());
                          sync(be);
                          outs[b] = download_vec<int32_t>(be, out.get(), 2);
                      }
                      const int32_t acc = outs[1][0], acc_ref = outs[0][0];
                      if (acc != acc_ref) {
                          // Only a coin within rounding of its threshold may go the other way.
                          const int32_t j = std::min(acc, acc_ref);
                          if (acc < 0 || acc >= s.n) {
                              c.problem(cat("accepted ", acc, " out of range [0, ", s.n, ")"));
                              return;
                          }
                          const int32_t draft = tokens[size_t(j + 1)];
                          const float pd = p[size_t(j * s.vocab + draft)];
                          const float qd = s.with_q ? q[size_t(j * s.vocab + draft)] : 1.f;
                          const float u = rng_uniform(key, uint32_t(j + 1), RNG_ACCEPT);
                          if (std::fabs(double(u) * qd - pd) <= 1e-6 * std::max(pd, qd))
                              c.boundary();
                          else
                              c.problem(cat("accepted ", acc, ", host ", acc_ref, " (coin of draft ",
                                            j + 1, ": u*q=", double(u) * qd, " p=", pd, ")"));
                          return;
                      }
                      const int32_t t = outs[1][1];
                      if (t == outs[0][1]) return;
                      // Same acceptance, different token: it must still be a valid draw from the
                      // distribution the host drew from (the row, or the residual max(p - q, 0)).
                      std::vector<float> dist(p.begin() + acc * s.vocab, p.begin() + (acc + 1) * s.vocab);
                      if (acc + 1 < s.n) {
                          double total = 0;
                          std::vector<float> residual(dist);
                          for (int64_t v = 0; v < s.vocab; ++v) {
                              const float qv = s.with_q ? q[size_t(acc * s.vocab + v)]
                                                        : (v == tokens[size_t(acc + 1)] ? 1.f : 0.f);
                              residual[size_t(v)] = std::max(residual[size_t(v)] - qv, 0.f);
                              total += residual[size_t(v)];
                          }
                          if (total > 0) dist = residual;
                      }
                      const float u = rng_uniform(key, uint32_t(acc), RNG_SAMPLE);
                      if (draw_consistent(dist.data(), s.vocab, u, t, kCdfSlack))
                          c.boundary();
                      else
                          c.problem(cat("next token ", t, ", host ", outs[0][1], " (accepted ", acc,
                                        ", u=", u, "): not a draw the CDF allows"));
                  });
}

// ----------------------------------------------------------------------------------------------

void usage() {
    std::printf("usage: test_ops [--seed N] [--smoke | --quick | --full] [--filter a,b] [--verbose]\n"
                "                [--self-test [--inject-fault OP]]\n");
}

}  // namespace

int main(int argc, char **argv) {
    g_opt.seed = uint64_t(std::chrono::system_clock::now().time_since_epoch().count()) & 0xFFFFFFFFull;
    if (const char *env = std::getenv("DFLASH_TEST_SEED")) g_opt.seed = std::strtoull(env, nullptr, 0);
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--seed" && i + 1 < argc) {
            g_opt.seed = std::strtoull(argv[++i], nullptr, 0);
        } else if (a == "--smoke") {
            g_opt.level = SMOKE;
        } else if (a == "--quick") {
            g_opt.level = QUICK;
        } else if (a == "--full") {
            g_opt.level = FULL;
        } else if (a == "--filter" && i + 1 < argc) {
            std::string list = argv[++i];
            size_t start = 0;
            while (start <= list.size()) {
                const size_t comma = list.find(',', start);
                const std::string item = list.substr(start, comma == std::string::npos ? std::string::npos
                                                                                        : comma - start);
                if (!item.empty()) g_opt.filters.push_back(item);
                if (comma == std::string::npos) break;
                start = comma + 1;
            }
        } else if (a == "--self-test") {
            g_opt.self_test = true;
        } else if (a == "--inject-fault" && i + 1 < argc) {
            g_opt.fault = argv[++i];
        } else if (a == "--verbose" || a == "-v") {
            g_opt.verbose = true;
        } else if (a == "--help" || a == "-h") {
            usage();
            return 0;
        } else {
            usage();
            return 2;
        }
    }
    const char *level_names[] = {"smoke", "quick", "default", "full"};
    std::printf("test_ops: cuda backend vs host backend, seed %" PRIu64 ", level %s\n", g_opt.seed,
                level_names[g_opt.level]);

    std::shared_ptr<Backend> host = make_host_backend(), cuda;
    if (g_opt.self_test) {
        cuda = std::make_shared<EmulatedBf16Backend>(host, g_opt.fault);
        std::printf("self-test: the cuda backend is replaced by a bf16 emulation on the CPU%s\n",
                    g_opt.fault.empty() ? "" : cat(", with a fault injected into ", g_opt.fault).c_str());
    } else {
        try {
            cuda = make_cuda_backend(0, 0, false);
        } catch (const Error &e) {
            std::printf("SKIP: no usable CUDA device: %s: %s\n", dflash_status_string(e.status()),
                        e.what());
            return 77;
        }
        cudaDeviceProp prop{};
        if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
            std::printf("device: %s (sm_%d%d), library built for %s\n", prop.name, prop.major,
                        prop.minor, cuda_arch_list());
        if (const char *missing = cuda->missing_ops())
            std::printf("note: the cuda backend reports missing ops: %s\n", missing);
    }
    std::shared_ptr<Backend> cuda_tail;  // the same device with the rope tail (gemm_qkv_rope's cases)
    if (!g_opt.self_test) {
        const char *was = std::getenv("DFLASH_QKV_ROPE_TAIL");
        const std::string saved = was ? was : "";
        setenv("DFLASH_QKV_ROPE_TAIL", "1", 1);
        cuda_tail = make_cuda_backend(0, 0, false);
        if (was)
            setenv("DFLASH_QKV_ROPE_TAIL", saved.c_str(), 1);
        else
            unsetenv("DFLASH_QKV_ROPE_TAIL");
    }
    H = host.get();
    C = cuda.get();
    CT = cuda_tail.get();
    size_t free0 = 0, free1 = 0, total = 0;
    if (!g_opt.self_test) cudaMemGetInfo(&free0, &total);
    const auto start = std::chrono::steady_clock::now();

    test_convert_rows();
    test_embed();
    test_rms_norm();
    test_add_rms_norm();
    test_head_norm_rope();
    test_gemm();
    test_gemm_rows_agree();
    test_gemm_swiglu();
    test_gemm_fused();
    test_gemm_wide();
    test_rope();
    test_kv_write();
    test_qkv_norm_rope_write();
    test_attention();
    test_add();
    test_swiglu();
    test_copy_rows();
    test_logits();
    test_logits_argmax();
    test_sampling_probs();
    test_sample_rows();
    test_greedy_accept();
    test_rejection_accept();

    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!g_opt.self_test) {
        cudaMemGetInfo(&free1, &total);
        std::printf("device memory in use: %.1f MiB before the ops, %.1f MiB after (of %.0f MiB)\n",
                    double(total - free0) / 1048576.0, double(total - free1) / 1048576.0,
                    double(total) / 1048576.0);
    }
    std::printf("time: %.1f s\n", secs);
    if (g_totals.cases == 0) {
        std::printf("FAILED: no case matched the filter\n");
        return 1;
    }
    if (g_totals.failed) {
        std::string groups;
        for (const auto &n : g_totals.failed_groups) groups += (groups.empty() ? "" : ",") + n;
        std::printf("FAILED: %d of %d case(s) in %s. Rerun: test_ops --seed %" PRIu64 " --filter %s%s\n",
                    g_totals.failed, g_totals.cases, groups.c_str(), g_opt.seed, groups.c_str(),
                    g_opt.level == SMOKE ? " --smoke" : g_opt.level == QUICK ? " --quick"
                                                      : g_opt.level == FULL ? " --full" : "");
        return std::min(g_totals.failed, 255);
    }
    std::printf("ALL OK (%d cases%s)\n", g_totals.cases,
                g_totals.boundary ? cat(", ", g_totals.boundary, " near-boundary accepted").c_str() : "");
    return 0;
}
