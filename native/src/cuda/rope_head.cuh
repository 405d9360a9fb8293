// rope_head.cuh: one head's RMSNorm and rotate-half RoPE by one warp: the arithmetic of rope.cu's kernels, written
// once, for them and for the q/k/v GEMM's rope tail (gemv_kernels.cuh, RopeTail), which must store the same bits.
// (Session 39 wrote it for a fold into the attention kernel too, since reverted; rope.cu's PTX was unchanged by it.)
#pragma once

#include "common.cuh"

namespace dflash {
namespace cuda {

constexpr int kMaxPairsPerLane = 4;  // head_dim <= 256

// src[j]: CG (the rope tail, reading what other blocks of its grid stored) loads through L2 only, never a line
// this SM's L1 may hold from before.
template <bool CG>
__device__ __forceinline__ bf16 head_load(const bf16 *src, int j) {
    if constexpr (CG)
        return __ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short *>(src) + j));
    else
        return src[j];
}

// norm_rope_pairs' loads: lane's pairs j = lane + 32 i (i < P; zeros past head_dim / 2) into a and b. Returns
// their sum of squares, accumulated pair by pair.
template <int P, bool CG = false>
__device__ __forceinline__ float head_pairs_load(const bf16 *src, int head_dim, int lane, float (&a)[P],
                                                 float (&b)[P]) {
    const int half = head_dim / 2;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int j = lane + 32 * i;
        a[i] = j < half ? to_float(head_load<CG>(src, j)) : 0.f;
        b[i] = j < half ? to_float(head_load<CG>(src, j + half)) : 0.f;
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
template <int P, bool CG = false>
__device__ __forceinline__ void norm_rope_pairs(const bf16 *src, int head_dim, bool norm, float eps,
                                                const float (&cs)[P], const float (&sn)[P], const float (&wa)[P],
                                                const float (&wb)[P], bf16 *dst, bf16 *copy, int lane) {
    float a[P], b[P];
    const float ss = head_pairs_load<P, CG>(src, head_dim, lane, a, b);
    head_pairs_finish<P>(a, b, ss, head_dim, norm, eps, cs, sn, wa, wb, dst, copy, lane);
}

// What a lane of norm_rope_head needs besides the head: its pairs' rotations and norm weights. They depend only
// on the position, inv_freq and the norm weight, which no kernel of the step writes (the positions come with
// the step's upload), so rope.cu's kernels compute them before pdl_wait, off the step's critical path.
struct LaneRope {
    float cs[kMaxPairsPerLane], sn[kMaxPairsPerLane], wa[kMaxPairsPerLane], wb[kMaxPairsPerLane];
};
__device__ __forceinline__ LaneRope lane_rope(int head_dim, const bf16 *w, float pos, const float *inv_freq,
                                              float attention_factor, int lane) {
    const int half = head_dim / 2;
    LaneRope r;
#pragma unroll
    for (int i = 0; i < kMaxPairsPerLane; ++i) {
        const int j = lane + 32 * i;
        r.cs[i] = r.sn[i] = r.wa[i] = r.wb[i] = 0.f;
        if (j >= half) continue;
        sincosf(pos * inv_freq[j], &r.sn[i], &r.cs[i]);
        r.cs[i] *= attention_factor;
        r.sn[i] *= attention_factor;
        if (w) r.wa[i] = to_float(w[j]), r.wb[i] = to_float(w[j + half]);
    }
    return r;
}

// One head of head_dim at v (this warp), in place: norm_rope_pairs with this lane's LaneRope.
template <bool CG = false>
__device__ __forceinline__ void norm_rope_head(bf16 *v, int head_dim, bool norm, float eps, const LaneRope &r,
                                               bf16 *copy, int lane) {
    norm_rope_pairs<kMaxPairsPerLane, CG>(v, head_dim, norm, eps, r.cs, r.sn, r.wa, r.wb, v, copy, lane);
}

// A v head from src to dst (this warp): every load first, then the stores (a loop of load-store pairs took one L2
// round trip per 32 elements: dst may alias src as far as the compiler knows), so this warp is not the kernel's
// tail.
template <bool CG = false>
__device__ __forceinline__ void copy_head(const bf16 *src, bf16 *dst, int head_dim, int lane) {
    bf16 vals[2 * kMaxPairsPerLane];
#pragma unroll
    for (int i = 0; i < 2 * kMaxPairsPerLane; ++i)
        if (lane + 32 * i < head_dim) vals[i] = head_load<CG>(src, lane + 32 * i);
#pragma unroll
    for (int i = 0; i < 2 * kMaxPairsPerLane; ++i)
        if (lane + 32 * i < head_dim) dst[lane + 32 * i] = vals[i];
}

}  // namespace cuda
}  // namespace dflash
