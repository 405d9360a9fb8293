// rope.hpp: RoPE inverse frequencies and cos/sin scale, computed as transformers 5 does.
//
// The backends only see a table inv_freq[head_dim/2] and one attention factor; every RoPE
// variant is resolved here, once, at drafter creation. Formulas follow
// transformers/modeling_rope_utils.py (_compute_default/_yarn/_llama3_parameters), using fp32
// where it uses fp32 tensors so the tables match to the last bit or two.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.hpp"

namespace dflash {

struct RopeTable {
    std::vector<float> inv_freq;  // [head_dim / 2]
    float attention_factor = 1.f;
};

inline void validate_rope(const dflash_rope_params &p) {
    if (p.type != DFLASH_ROPE_DEFAULT && p.type != DFLASH_ROPE_YARN && p.type != DFLASH_ROPE_LLAMA3)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "rope.type ", int(p.type), " is not a dflash_rope_type");
    if (!(p.theta > 0)) fail(DFLASH_STATUS_INVALID_ARGUMENT, "rope.theta ", p.theta, " must be > 0");
    if (p.type == DFLASH_ROPE_LLAMA3) {
        if (!(p.factor > 0)) fail(DFLASH_STATUS_INVALID_ARGUMENT, "llama3 rope.factor ", p.factor, " must be > 0");
        if (!(p.high_freq_factor > p.low_freq_factor))
            fail(DFLASH_STATUS_INVALID_ARGUMENT, "llama3 rope high_freq_factor ", p.high_freq_factor,
                 " must exceed low_freq_factor ", p.low_freq_factor);
    }
    if (p.type == DFLASH_ROPE_YARN && p.factor < 0)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "yarn rope.factor ", p.factor, " must be >= 0");
}

inline RopeTable compute_rope(const dflash_rope_params &p, int head_dim, int max_position) {
    const int dim = head_dim, half = head_dim / 2;
    const double original = p.original_max_position > 0 ? p.original_max_position : max_position;
    std::vector<float> pos_freqs(static_cast<size_t>(half));
    for (int i = 0; i < half; ++i)
        pos_freqs[i] = std::pow(float(p.theta), float(2 * i) / float(dim));

    RopeTable t;
    t.inv_freq.resize(size_t(half));
    if (p.type == DFLASH_ROPE_DEFAULT) {
        for (int i = 0; i < half; ++i) t.inv_freq[i] = 1.f / pos_freqs[i];
    } else if (p.type == DFLASH_ROPE_YARN) {
        double factor = p.factor > 0 ? p.factor : double(max_position) / original;
        auto get_mscale = [](double scale, double mscale) {
            return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
        };
        double attention = p.attention_factor;
        if (!(attention > 0))
            attention = (p.mscale != 0 && p.mscale_all_dim != 0)
                ? get_mscale(factor, p.mscale) / get_mscale(factor, p.mscale_all_dim)
                : get_mscale(factor, 1.0);
        const double beta_fast = p.beta_fast != 0 ? p.beta_fast : 32;
        const double beta_slow = p.beta_slow != 0 ? p.beta_slow : 1;
        auto correction_dim = [&](double rotations) {
            return (dim * std::log(original / (rotations * 2 * M_PI))) / (2 * std::log(p.theta));
        };
        double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
        if (p.truncate) {
            low = std::floor(low);
            high = std::ceil(high);
        }
        low = std::max(low, 0.0);
        high = std::min(high, double(dim - 1));
        if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
        for (int i = 0; i < half; ++i) {
            float ramp = (float(i) - float(low)) / (float(high) - float(low));
            ramp = std::min(1.f, std::max(0.f, ramp));
            const float extrapolation_factor = 1.f - ramp;
            const float extrapolation = 1.f / pos_freqs[i];
            const float interpolation = 1.f / (float(factor) * pos_freqs[i]);
            t.inv_freq[i] = interpolation * (1.f - extrapolation_factor) +
                            extrapolation * extrapolation_factor;
        }
        t.attention_factor = float(attention);
    } else {  // llama3
        const double factor = p.factor, old_len = original;
        const double low_wavelen = old_len / p.low_freq_factor;
        const double high_wavelen = old_len / p.high_freq_factor;
        for (int i = 0; i < half; ++i) {
            const float inv = 1.f / pos_freqs[i];
            const float wavelen = float(2 * M_PI) / inv;
            float scaled = wavelen > low_wavelen ? inv / float(factor) : inv;
            const float smooth = (float(old_len) / wavelen - float(p.low_freq_factor)) /
                                 float(p.high_freq_factor - p.low_freq_factor);
            const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
            if (medium) scaled = (1 - smooth) * scaled / float(factor) + smooth * scaled;
            t.inv_freq[i] = scaled;
        }
    }
    return t;
}

}  // namespace dflash
