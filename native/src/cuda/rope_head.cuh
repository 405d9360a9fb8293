// rope_head.cuh: one head's RMSNorm and rotate-half RoPE by one warp: the arithmetic of rope.cu's kernels, written
// once (session 39 wrote it for a fold into the attention kernel too, now on branch exp/attn-fold; rope.cu's PTX is
// unchanged by it: checked against session 38's).
#pragma once

#include "common.cuh"

namespace dflash {
namespace cuda {

// norm_rope_pairs' loads: lane's pairs j = lane + 32 i (i < P; zeros past head_dim / 2) into a and b. Returns
// their sum of squares, accumulated pair by pair.
template <int P>
__device__ __forceinline__ float head_pairs_load(const bf16 *src, int head_dim, int lane, float (&a)[P],
                                                 float (&b)[P]) {
    const int half = head_dim / 2;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int j = lane + 32 * i;
        a[i] = j < half ? to_float(src[j]) : 0.f;
        b[i] = j < half ? to_float(src[j + half]) : 0.f;
        ss += a[i] * a[i] + b[i] * b[i];
    }
    return ss;
}

// norm_rope_pairs after its loads (head_pairs_load, which returned ss): the norm, the rotation and the stores.
template <int P>
__device__ __forceinline__ void head_pairs_finish(float (&a)[P], float (&b)[P], float ss, int head_dim, bool norm,
                                                  float eps, const float (&cs)[P], const float (&sn)[P],
                                                  const float (&wa)[P], const float (&wb)[P], bf16 *dst, bf16 *copy,
                                                  int lane) {
    const int half = head_dim / 2;
    if (norm) {
        const float inv = rsqrtf(warp_sum(ss) / float(head_dim) + eps);
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const int j = lane + 32 * i;
            if (j < half) {
                a[i] = to_float(to_bf16(wa[i] * (a[i] * inv)));
                b[i] = to_float(to_bf16(wb[i] * (b[i] * inv)));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int j = lane + 32 * i;
        if (j >= half) break;
        const bf16 lo = to_bf16(a[i] * cs[i] - b[i] * sn[i]), hi = to_bf16(b[i] * cs[i] + a[i] * sn[i]);
        dst[j] = lo;
        dst[j + half] = hi;
        if (copy) {
            copy[j] = lo;
            copy[j + half] = hi;
        }
    }
}

// The head of head_dim at src (this warp; lane owns rotation pairs j = lane + 32 i, i < P, for j < head_dim / 2,
// and j + head_dim / 2): RMSNorm with weights wa / wb of its pairs (fp32 statistics, the result rounded to bf16
// as rms_norm stores it; skipped when `norm` is false), then the rotation by cos cs / sin sn (attention_factor
// applied), rounded to bf16 into dst and, when not null, copy (a k head into its cache slot). dst may be src:
// every load comes first. rope.cu's kernels inline it.
template <int P>
__device__ __forceinline__ void norm_rope_pairs(const bf16 *src, int head_dim, bool norm, float eps,
                                                const float (&cs)[P], const float (&sn)[P], const float (&wa)[P],
                                                const float (&wb)[P], bf16 *dst, bf16 *copy, int lane) {
    float a[P], b[P];
    const float ss = head_pairs_load<P>(src, head_dim, lane, a, b);
    head_pairs_finish<P>(a, b, ss, head_dim, norm, eps, cs, sn, wa, wb, dst, copy, lane);
}

}  // namespace cuda
}  // namespace dflash
