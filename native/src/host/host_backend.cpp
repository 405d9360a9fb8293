// host_backend.cpp: every op as plain C++ with fp32 activations.
//
// This backend is the reference the cuda backend is checked against and the no-GPU fallback
// that lets CI run the whole lifecycle. It favours obviously-correct loops over speed; the only
// concession is converting each weight row to fp32 once and using several partial sums so the
// compiler can vectorise the dot products. "Device" memory is host memory.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "../backend.hpp"

namespace dflash {
namespace {

float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

void load_row(WeightView w, int64_t row, float *out) {
    if (w.tiled) {  // DFLASH_HOST_TILED=1 only: the row's 64-wide pieces, tile by tile
        for (int64_t c = 0; c < w.cols; ++c) out[c] = load_as_float(w.data, w.dtype, tiled_index(w.cols, row, c));
        return;
    }
    const int64_t base = row * w.cols;
    if (w.dtype == DFLASH_DTYPE_F32) {
        std::memcpy(out, static_cast<const float *>(w.data) + base, size_t(w.cols) * 4);
        return;
    }
    for (int64_t c = 0; c < w.cols; ++c) out[c] = load_as_float(w.data, w.dtype, base + c);
}

// 1 / rms of x[0, n): the squares summed in order (rms_norm's statistics, and a folded norm's).
float inv_rms(const float *x, int64_t n, float eps) {
    float ss = 0.f;
    for (int64_t c = 0; c < n; ++c) ss += x[c] * x[c];
    return 1.f / std::sqrt(ss / float(n) + eps);
}

class HostBackend final : public Backend {
public:
    dflash_backend kind() const override { return DFLASH_BACKEND_HOST; }
    dflash_dtype act_dtype() const override { return DFLASH_DTYPE_F32; }

    void *alloc(size_t bytes) override {
        void *p = std::malloc(bytes ? bytes : 1);
        if (!p) fail(DFLASH_STATUS_OUT_OF_MEMORY, "host allocation of ", bytes, " bytes failed");
        return p;
    }
    void release(void *ptr) noexcept override { std::free(ptr); }
    void upload(void *dst, const void *src, size_t bytes) override { std::memcpy(dst, src, bytes); }
    void download(void *dst, const void *src, size_t bytes) override { std::memcpy(dst, src, bytes); }
    void copy(void *dst, const void *src, size_t bytes) override { std::memmove(dst, src, bytes); }
    void synchronize() override {}

    void convert_rows(const void *src, dflash_dtype src_dtype, bool, int64_t n, int64_t width,
                      void *dst) override {
        float *out = static_cast<float *>(dst);
        for (int64_t i = 0; i < n * width; ++i) out[i] = load_as_float(src, src_dtype, i);
    }

    void embed(const int32_t *tokens, int64_t n, WeightView table, float scale,
               void *out, float *ss_out) override {
        float *y = static_cast<float *>(out);
        for (int64_t i = 0; i < n; ++i) {
            load_row(table, tokens[i], y + i * table.cols);
            for (int64_t c = 0; c < table.cols; ++c) y[i * table.cols + c] *= scale;
        }
        if (ss_out) sum_square_parts(y, n, table.cols, table.cols, ss_out);
    }

    void rms_norm(const void *x, int64_t rows, int64_t groups, int64_t dim, int64_t ld_x,
                  WeightView w, float eps, void *y, int64_t ld_y) override {
        std::vector<float> weight(static_cast<size_t>(dim));
        load_row(w, 0, weight.data());
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t g = 0; g < groups; ++g) {
                const float *in = static_cast<const float *>(x) + r * ld_x + g * dim;
                float *o = static_cast<float *>(y) + r * ld_y + g * dim;
                const float inv = inv_rms(in, dim, eps);
                for (int64_t c = 0; c < dim; ++c) o[c] = weight[c] * (in[c] * inv);
            }
        }
    }

    // Row-major weights, unless DFLASH_HOST_TILED=1: then GEMM weights are tiled as the cuda
    // backend tiles them (its default), so the CPU tests cover the models' tiling (which tensors,
    // slices, a tied lm_head left row-major) with the same arithmetic, bit for bit. Read at each
    // finalize.
    bool tiles_gemm_weights() const override {
        const char *v = std::getenv("DFLASH_HOST_TILED");
        return v && v[0] == '1';
    }
    void tile_gemm_weight(const WeightView &src, void *dst) override {
        const size_t elem = dtype_size(src.dtype);
        std::memset(dst, 0, size_t(tiled_elements(src.rows, src.cols)) * elem);
        for (int64_t r = 0; r < src.rows; ++r)
            for (int64_t c = 0; c < src.cols; ++c)
                std::memcpy(static_cast<char *>(dst) + size_t(tiled_index(src.cols, r, c)) * elem,
                            static_cast<const char *>(src.data) + size_t(r * src.cols + c) * elem, elem);
    }

    void gemm(const void *x, int64_t m, int64_t ldx, WeightView w, void *y, int64_t ldy, GemmRows,
              GemmFuse fuse) override {  // one kernel: every call is uniform
        const float *in = static_cast<const float *>(x);
        float *out = static_cast<float *>(y);
        if (fuse.accumulate && ldy != w.rows)
            fail(DFLASH_STATUS_INTERNAL, "gemm: accumulate needs ldy == N (", ldy, " != ", w.rows, ")");
        std::vector<float> scale(size_t(m), 1.f);  // the rows' RMSNorm factors (rms_norm's sum, in order)
        for (int64_t i = 0; fuse.norm_eps > 0.f && i < m; ++i)
            scale[size_t(i)] = inv_rms(in + i * ldx, w.cols, fuse.norm_eps);
        std::vector<float> row(size_t(w.cols));
        for (int64_t n = 0; n < w.rows; ++n) {
            load_row(w, n, row.data());
            for (int64_t i = 0; i < m; ++i) {
                float v = dot(in + i * ldx, row.data(), w.cols);
                if (fuse.norm_eps > 0.f) v *= scale[size_t(i)];
                out[i * ldy + n] = fuse.accumulate ? out[i * ldy + n] + v : v;
            }
        }
        if (fuse.ss_out) sum_square_parts(out, m, w.rows, ldy, fuse.ss_out);  // of the stored rows
    }
    // DFLASH_HOST_FOLD=1 only (read at each finalize): the models' folded path on the CPU.
    bool folds_norms() const override {
        const char *v = std::getenv("DFLASH_HOST_FOLD");
        return v && v[0] == '1';
    }
    void fold_norm(WeightView w, WeightView g) override {
        if (w.tiled) fail(DFLASH_STATUS_INTERNAL, "fold_norm: the weight is tiled (fold before tiling)");
        std::vector<float> gv(size_t(g.cols));
        load_row(g, 0, gv.data());
        void *data = const_cast<void *>(w.data);
        for (int64_t r = 0; r < w.rows; ++r)
            for (int64_t c = 0; c < w.cols; ++c) {
                const int64_t i = r * w.cols + c;
                const float v = load_as_float(w.data, w.dtype, i) * gv[size_t(c)];
                switch (w.dtype) {
                    case DFLASH_DTYPE_F32: static_cast<float *>(data)[i] = v; break;
                    case DFLASH_DTYPE_BF16: static_cast<uint16_t *>(data)[i] = float_to_bf16(v); break;
                    case DFLASH_DTYPE_F16: {
                        const _Float16 h = static_cast<_Float16>(v);
                        std::memcpy(static_cast<uint16_t *>(data) + i, &h, 2);
                        break;
                    }
                    default: fail(DFLASH_STATUS_INTERNAL, "fold_norm: weight dtype ", dtype_name(w.dtype));
                }
            }
    }

    void rope(void *x, int64_t rows, int64_t heads, int64_t head_dim, int64_t ld,
              const int32_t *positions, const float *inv_freq, float attention_factor) override {
        const int64_t half = head_dim / 2;
        std::vector<float> cosv(static_cast<size_t>(half)), sinv(static_cast<size_t>(half));
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t i = 0; i < half; ++i) {
                const float angle = float(positions[r]) * inv_freq[i];  // fp32 like transformers
                cosv[i] = std::cos(angle) * attention_factor;
                sinv[i] = std::sin(angle) * attention_factor;
            }
            for (int64_t h = 0; h < heads; ++h) {
                float *v = static_cast<float *>(x) + r * ld + h * head_dim;
                for (int64_t i = 0; i < half; ++i) {
                    const float a = v[i], b = v[i + half];
                    v[i] = a * cosv[i] - b * sinv[i];
                    v[i + half] = b * cosv[i] + a * sinv[i];
                }
            }
        }
    }

    void kv_write(const void *k, const void *v, int64_t rows, int64_t ld, const int32_t *slots,
                  int64_t kv_width, void *k_cache, void *v_cache) override {
        for (int64_t r = 0; r < rows; ++r) {
            if (slots[r] < 0) continue;  // a padding row
            std::memcpy(static_cast<float *>(k_cache) + int64_t(slots[r]) * kv_width,
                        static_cast<const float *>(k) + r * ld, size_t(kv_width) * 4);
            std::memcpy(static_cast<float *>(v_cache) + int64_t(slots[r]) * kv_width,
                        static_cast<const float *>(v) + r * ld, size_t(kv_width) * 4);
        }
    }

    void attention(const void *q, int64_t ldq, int64_t nq, const int32_t *q_positions, int64_t n_heads,
                   int64_t n_kv_heads, int64_t head_dim, float scale, AttentionMask mask,
                   const PagedKeys &keys, void *out) override {
        const int64_t kv_width = n_kv_heads * head_dim;
        const int64_t group = n_heads / n_kv_heads;
        std::vector<int64_t> slot(size_t(keys.num_keys));
        std::vector<int32_t> key_pos(size_t(keys.num_keys));
        for (int64_t j = 0; j < keys.num_keys; ++j) {
            const int64_t ring = (keys.first_key + j) % keys.ring_slots;
            slot[j] = int64_t(keys.block_table[ring / keys.block_size]) * keys.block_size +
                      ring % keys.block_size;
            key_pos[j] = keys.slot_positions[ring];
        }
        const float *kc = static_cast<const float *>(keys.k_cache);
        const float *vc = static_cast<const float *>(keys.v_cache);
        std::vector<float> score(size_t(keys.num_keys));
        for (int64_t i = 0; i < nq; ++i) {
            const int32_t qp = q_positions[i];
            for (int64_t h = 0; h < n_heads; ++h) {
                const float *qv = static_cast<const float *>(q) + i * ldq + h * head_dim;
                const int64_t kvh = h / group;
                float best = -std::numeric_limits<float>::infinity();
                for (int64_t j = 0; j < keys.num_keys; ++j) {
                    const int32_t kp = key_pos[j];
                    bool visible = true;
                    if (mask.causal) visible = visible && kp <= qp;
                    if (mask.window > 0) {
                        visible = visible && int64_t(qp) - kp < mask.window;
                        if (!mask.causal) visible = visible && int64_t(kp) - qp < mask.window;
                    }
                    score[j] = visible
                        ? dot(qv, kc + slot[j] * kv_width + kvh * head_dim, head_dim) * scale
                        : -std::numeric_limits<float>::infinity();
                    best = std::max(best, score[j]);
                }
                float *o = static_cast<float *>(out) + (i * n_heads + h) * head_dim;
                std::fill(o, o + head_dim, 0.f);
                float total = 0.f;
                for (int64_t j = 0; j < keys.num_keys; ++j) {
                    if (score[j] == -std::numeric_limits<float>::infinity()) continue;
                    const float p = std::exp(score[j] - best);
                    total += p;
                    const float *vv = vc + slot[j] * kv_width + kvh * head_dim;
                    for (int64_t c = 0; c < head_dim; ++c) o[c] += p * vv[c];
                }
                for (int64_t c = 0; c < head_dim; ++c) o[c] /= total;
            }
        }
    }

    void add(void *y, const void *x, int64_t n) override {
        float *a = static_cast<float *>(y);
        const float *b = static_cast<const float *>(x);
        for (int64_t i = 0; i < n; ++i) a[i] += b[i];
    }

    void swiglu(const void *gate_up, int64_t rows, int64_t inter, void *out) override {
        for (int64_t r = 0; r < rows; ++r) {
            const float *g = static_cast<const float *>(gate_up) + r * 2 * inter;
            float *o = static_cast<float *>(out) + r * inter;
            for (int64_t c = 0; c < inter; ++c) o[c] = g[c] / (1.f + std::exp(-g[c])) * g[inter + c];
        }
    }

    void logits_argmax(const void *h, int64_t m, WeightView lm_head, float multiplier,
                       float softcap, int32_t *tokens) override {
        const float *in = static_cast<const float *>(h);
        std::vector<float> best(size_t(m), -std::numeric_limits<float>::infinity());
        std::fill(tokens, tokens + m, 0);
        std::vector<float> row(size_t(lm_head.cols));
        for (int64_t v = 0; v < lm_head.rows; ++v) {
            load_row(lm_head, v, row.data());
            for (int64_t i = 0; i < m; ++i) {
                float logit = dot(in + i * lm_head.cols, row.data(), lm_head.cols) * multiplier;
                if (softcap > 0.f) logit = std::tanh(logit / softcap) * softcap;
                if (logit > best[i]) {  // strict: the lowest index wins ties, like torch.argmax
                    best[i] = logit;
                    tokens[i] = int32_t(v);
                }
            }
        }
    }

    void copy_rows(const void *src, int64_t ld_src, int64_t rows, int64_t width, void *dst,
                   int64_t ld_dst) override {
        for (int64_t r = 0; r < rows; ++r)
            std::memcpy(static_cast<float *>(dst) + r * ld_dst,
                        static_cast<const float *>(src) + r * ld_src, size_t(width) * 4);
    }

    void logits(const void *h, int64_t m, WeightView lm_head, float multiplier, float softcap,
                float *out) override {
        const float *in = static_cast<const float *>(h);
        std::vector<float> row(static_cast<size_t>(lm_head.cols));
        for (int64_t v = 0; v < lm_head.rows; ++v) {
            load_row(lm_head, v, row.data());
            for (int64_t i = 0; i < m; ++i) {
                float logit = dot(in + i * lm_head.cols, row.data(), lm_head.cols) * multiplier;
                if (softcap > 0.f) logit = std::tanh(logit / softcap) * softcap;
                out[i * lm_head.rows + v] = logit;
            }
        }
    }

    void sampling_probs(float *rows, int64_t m, int64_t vocab, float temperature, float top_p,
                        int32_t top_k) override {
        std::vector<int32_t> order(static_cast<size_t>(vocab));
        for (int64_t i = 0; i < m; ++i) {
            float *row = rows + i * vocab;
            for (int64_t v = 0; v < vocab; ++v) row[v] /= temperature;
            // Descending by score; ties keep the lower index first (a stable order).
            for (int64_t v = 0; v < vocab; ++v) order[v] = int32_t(v);
            std::stable_sort(order.begin(), order.end(),
                             [row](int32_t a, int32_t b) { return row[a] > row[b]; });
            const int64_t kept = (top_k > 0 && top_k < vocab) ? top_k : vocab;
            const float best = row[order[0]];
            double total = 0;
            for (int64_t r = 0; r < kept; ++r) total += std::exp(double(row[order[r]]) - best);
            std::vector<float> probs(static_cast<size_t>(kept));
            for (int64_t r = 0; r < kept; ++r)
                probs[r] = float(std::exp(double(row[order[r]]) - best) / total);
            int64_t keep = kept;
            if (top_p < 1.f) {
                double cumulative = 0, kept_mass = 0;
                keep = 0;
                for (int64_t r = 0; r < kept; ++r) {
                    if (cumulative < top_p) {  // mass strictly before this token < top_p
                        keep = r + 1;
                        kept_mass += probs[r];
                    }
                    cumulative += probs[r];
                }
                for (int64_t r = 0; r < keep; ++r) probs[r] = float(probs[r] / kept_mass);
            }
            std::fill(row, row + vocab, 0.f);
            for (int64_t r = 0; r < keep; ++r) row[order[r]] = probs[r];
        }
    }

    static int32_t draw(const float *probs, int64_t vocab, float u) {
        double total = 0;
        for (int64_t v = 0; v < vocab; ++v) total += probs[v];
        const double target = double(u) * total;
        double cumulative = 0;
        int32_t last_nonzero = 0;
        for (int64_t v = 0; v < vocab; ++v) {
            if (probs[v] <= 0.f) continue;
            cumulative += probs[v];
            last_nonzero = int32_t(v);
            if (cumulative > target) return int32_t(v);
        }
        return last_nonzero;  // rounding left u * total just past the sum
    }

    void sample_rows(const float *probs, int64_t m, int64_t vocab, RngKey key,
                     uint32_t first_row, uint32_t purpose, int32_t *out) override {
        for (int64_t i = 0; i < m; ++i)
            out[i] = draw(probs + i * vocab, vocab, rng_uniform(key, first_row + uint32_t(i), purpose));
    }

    void greedy_accept(const int32_t *tokens, const int32_t *posterior, int64_t n,
                       int32_t *out) override {
        int32_t accepted = 0;
        while (accepted + 1 < n && tokens[accepted + 1] == posterior[accepted]) ++accepted;
        out[0] = accepted;
        out[1] = posterior[accepted];
    }

    void rejection_accept(const float *p, const int32_t *tokens, const float *q, int64_t n,
                          int64_t vocab, RngKey key, int32_t *out) override {
        int32_t accepted = 0;
        while (accepted + 1 < n) {
            const int32_t draft = tokens[accepted + 1];
            const float p_draft = p[accepted * vocab + draft];
            const float q_draft = q ? q[accepted * vocab + draft] : 1.f;
            if (!(rng_uniform(key, uint32_t(accepted + 1), RNG_ACCEPT) * q_draft < p_draft)) break;
            ++accepted;
        }
        const float *row = p + accepted * vocab;
        const float u = rng_uniform(key, uint32_t(accepted), RNG_SAMPLE);
        if (accepted + 1 == n) {
            out[1] = draw(row, vocab, u);
        } else {
            std::vector<float> residual(row, row + vocab);
            const int32_t draft = tokens[accepted + 1];
            double total = 0;
            for (int64_t v = 0; v < vocab; ++v) {
                const float qv = q ? q[accepted * vocab + v] : (v == draft ? 1.f : 0.f);
                residual[v] = std::max(residual[v] - qv, 0.f);
                total += residual[v];
            }
            out[1] = draw(total > 0 ? residual.data() : row, vocab, u);
        }
        out[0] = accepted;
    }
};

}  // namespace

std::shared_ptr<Backend> make_host_backend() { return std::make_shared<HostBackend>(); }

}  // namespace dflash
