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

// norm_rope_head's arithmetic for one head of HD (64 or 128) spread over a quad of lanes, so that a warp norms
// and rotates 8 heads at once, their loads all in flight together: quad lane q holds the 16-byte pieces q, q + 4,
// q + 8, ... of the head, i.e. norm_rope_head's lanes 8q .. 8q + 7 ("virtual lanes": pairs j = vl + 32 i). The
// sums of squares are norm_rope_head's, in its order: per virtual lane over i, then warp_sum's butterfly (xor 16
// and 8 across the quad, 4, 2 and 1 within a lane), so the results have the same bits. Every lane of the warp
// must call it (the butterfly's shuffles); `store` false keeps a lane's results (a head past the last).
template <int HD>
struct QuadHead {
    uint4 piece[HD / 32];  // pieces q + 4k, k = 0 .. HD / 32 - 1
};

template <int HD>
__device__ __forceinline__ void load_quad_head(const bf16 *src, int q, QuadHead<HD> &h) {
#pragma unroll
    for (int k = 0; k < HD / 32; ++k) h.piece[k] = load_act16(src + (q + 4 * k) * 8);
}

// rot: the head's row's rotation, per pair j: (cos, sin)(pos * inv_freq[j]) times attention_factor, as
// norm_rope_head computes them.
template <int HD>
__device__ __forceinline__ void norm_rope_quad(const QuadHead<HD> &h, bf16 *dst, const bf16 *w, float eps,
                                               const float2 *rot, bf16 *copy, int q, bool store) {
    static_assert(HD == 64 || HD == 128, "a quad holds 64 or 128 elements");
    constexpr int kPairs = HD / 64;  // pairs per virtual lane (norm_rope_head's i)
    constexpr int kHalf = HD / 2;
    float a[kPairs][8], b[kPairs][8];
    // element e of a piece: the bf16 in the low (even e) or high half of word e / 2, widened exactly
    auto elem = [](const uint4 &p, int e) {
        const uint32_t word = e < 2 ? p.x : e < 4 ? p.y : e < 6 ? p.z : p.w;
        return __uint_as_float(e & 1 ? word & 0xffff0000u : word << 16);
    };
#pragma unroll
    for (int i = 0; i < kPairs; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e)
            a[i][e] = elem(h.piece[i], e), b[i][e] = elem(h.piece[i + kPairs], e);  // b: j + half, piece q + 4i + HD/16
    if (w) {
        float ss[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            ss[e] = 0.f;
#pragma unroll
            for (int i = 0; i < kPairs; ++i) ss[e] += a[i][e] * a[i][e] + b[i][e] * b[i][e];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[e] += __shfl_xor_sync(0xffffffffu, ss[e], 2);  // virtual xor 16
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[e] += __shfl_xor_sync(0xffffffffu, ss[e], 1);  // virtual xor 8
        float t4[8], t2[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) t4[e] = ss[e] + ss[e ^ 4];
#pragma unroll
        for (int e = 0; e < 8; ++e) t2[e] = t4[e] + t4[e ^ 2];
        const float total = t2[0] + t2[1];
        const float inv = rsqrtf(total / float(HD) + eps);
#pragma unroll
        for (int i = 0; i < kPairs; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int j = 8 * q + e + 32 * i;
                a[i][e] = to_float(to_bf16(to_float(w[j]) * (a[i][e] * inv)));
                b[i][e] = to_float(to_bf16(to_float(w[j + kHalf]) * (b[i][e] * inv)));
            }
    }
    if (!store) return;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
        uint32_t lo[4], hi[4];  // bf16 pairs (element 2k low, 2k + 1 high), rounded as to_bf16 rounds
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            float r_lo[2], r_hi[2];
#pragma unroll
            for (int d = 0; d < 2; ++d) {
                const float2 cs_sn = rot[8 * q + e + d + 32 * i];
                const float cs = cs_sn.x, sn = cs_sn.y;
                r_lo[d] = a[i][e + d] * cs - b[i][e + d] * sn;
                r_hi[d] = b[i][e + d] * cs + a[i][e + d] * sn;
            }
            const __nv_bfloat162 pl = __floats2bfloat162_rn(r_lo[0], r_lo[1]), ph = __floats2bfloat162_rn(r_hi[0], r_hi[1]);
            lo[e / 2] = *reinterpret_cast<const uint32_t *>(&pl);
            hi[e / 2] = *reinterpret_cast<const uint32_t *>(&ph);
        }
        const uint4 lo_piece = make_uint4(lo[0], lo[1], lo[2], lo[3]), hi_piece = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        const int p_lo = q + 4 * i, p_hi = p_lo + HD / 16;
        *reinterpret_cast<uint4 *>(dst + p_lo * 8) = lo_piece;
        *reinterpret_cast<uint4 *>(dst + p_hi * 8) = hi_piece;
        if (copy) {
            *reinterpret_cast<uint4 *>(copy + p_lo * 8) = lo_piece;
            *reinterpret_cast<uint4 *>(copy + p_hi * 8) = hi_piece;
        }
    }
}

}  // namespace cuda
}  // namespace dflash
