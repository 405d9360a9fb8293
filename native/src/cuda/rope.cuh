// rope.cuh: the per-head norm + rotation that rope.cu's kernels and attention.cu's fused attention
// (attention_qkv) share, so a head normed and rotated by either has the same bits.
#pragma once

#include "common.cuh"

namespace dflash {
namespace cuda {

// One warp per (row, head): lane owns rotation pairs j = lane, lane + 32, ... (j and j + half).
// Norm (fp32 statistics, result rounded to bf16 as rms_norm stores it), then the rotation.
constexpr int kMaxPairsPerLane = 4;  // head_dim <= 256

// One head of head_dim at src (this warp; read with coherent loads: a kernel before may have written it)
// into dst (may be src: in place): the norm with w (skipped when null), then the rotation; the result also
// goes to `copy` when it is not null (a k head into its cache slot).
__device__ __forceinline__ void norm_rope_head(const bf16 *src, bf16 *dst, int head_dim, const bf16 *w, float eps,
                                               float pos, const float *inv_freq, float attention_factor,
                                               bf16 *copy, int lane) {
    const int half = head_dim / 2;
    float a[kMaxPairsPerLane], b[kMaxPairsPerLane];
    float ss = 0.f;
    auto load = [](const bf16 *p) { return to_float(__ushort_as_bfloat16((unsigned short)load_act_u16(p))); };
#pragma unroll
    for (int i = 0; i < kMaxPairsPerLane; ++i) {
        const int j = lane + 32 * i;
        a[i] = j < half ? load(src + j) : 0.f;
        b[i] = j < half ? load(src + j + half) : 0.f;
        ss += a[i] * a[i] + b[i] * b[i];
    }
    if (w) {
        const float inv = rsqrtf(warp_sum(ss) / float(head_dim) + eps);
#pragma unroll
        for (int i = 0; i < kMaxPairsPerLane; ++i) {
            const int j = lane + 32 * i;
            if (j < half) {
                a[i] = to_float(to_bf16(to_float(w[j]) * (a[i] * inv)));
                b[i] = to_float(to_bf16(to_float(w[j + half]) * (b[i] * inv)));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < kMaxPairsPerLane; ++i) {
        const int j = lane + 32 * i;
        if (j >= half) break;
        float sn, cs;
        sincosf(pos * inv_freq[j], &sn, &cs);
        cs *= attention_factor;
        sn *= attention_factor;
        const bf16 lo = to_bf16(a[i] * cs - b[i] * sn), hi = to_bf16(b[i] * cs + a[i] * sn);
        dst[j] = lo;
        dst[j + half] = hi;
        if (copy) {
            copy[j] = lo;
            copy[j + half] = hi;
        }
    }
}

}  // namespace cuda
}  // namespace dflash
