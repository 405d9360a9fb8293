// gemv_kernels.cuh: the small-M GEMM family (M = block rows x batch), y[m, N] = x[m, K] . w[N, K]^T: its
// kernels and their launch (launch_gemm), and what the family's TUs share.
//
// At batch 1 every step is bound by streaming the weights once, so the kernel is shaped around
// the weight stream: tensor-core mma.sync m16n8k16 (bf16 in, fp32 accumulate) over a 16-row tile
// of x, 64-wide k chunks. M = 1..16 is one tile (rows past M are zeros), so the weights are read
// once per step whatever the block width.
//
// Two kernels, the same arithmetic: gemm_stream_kernel (16-byte aligned x and w, K % 8 == 0: every
// real checkpoint) gives each warp a private ring of kStages chunks in shared memory, filled with
// cp.async (L2 only, zero-filled past N and K), so the bytes in flight per SM are set by the ring,
// not by registers (the register-fed kernel reached 3.2-3.5 TB/s on the H200, one 150-register
// block per SM at the widest tiles); gemm_mma_kernel loads straight into registers and takes
// every other layout. Both run the same mma sequence for the same tiling, so they agree bit for bit.
// With tiled weights (backend.hpp's 16 x 64 tiles; the default, DFLASH_GEMM_TILED=0 keeps them
// row-major) the ring-fed kernel reads each warp's share as one contiguous run; it keeps up to 128
// registers and a 7-chunk ring per warp (2 blocks per SM), its k-split chosen for those slots. Ring rows
// are swizzled, not padded (ring_offset): session 16 on the H200, 7 chunks (persistent 6) against 6 (5) in
// padded rows: verify 1.2%, propose 3% faster, decode the same.
// A tiled launch of more than one wave of blocks may run persistent (PERSIST, DFLASH_GEMM_PERSIST=MASK picks the
// calls, gemv.cu; none by default since session 37): one wave of blocks, each streaming its column blocks' chunks
// as one sequence, so no block's ramp waits on another's end (session 13 on the H200: verify 4.5%, propose 4-6%
// faster; since the issued trigger and the x rings, 0.7-2% slower on the H100).
//
// The k permutation: mma's k slots are a free relabelling of the sum, so lane (g = lane / 4,
// q = lane % 4) loads k0 + q*16 .. +15 of its row (16 contiguous bf16: two 16-byte loads) and
// feeds them to four mma steps; x is loaded with the same relabelling.
//
// Batch invariance (DESIGN §5): an output element is the same sequence of mma steps over the
// same k chunks, then the same fixed-order sum over the warps that split K, whatever M is and
// whichever rows share its tile (mma computes each row independently). How K is split (ks)
// depends only on N, K and the device (SM count, resident blocks). So a row
// verified among 16 gives the same bits as the same row decoded alone.
//
// Epilogues: bf16 store (GEMM), fp32 logits with multiplier/softcap, or a fused argmax that
// never writes logits: per-block (value, index) partial maxima, then a small reduce kernel.
//
// A folded RMSNorm (FUSE kNorm, ring-fed kernels; Backend::folds_norms): x is the unnormed residual
// stream and w's columns carry the norm's weight, so a row's product only needs its factor
// rsqrt(mean(x^2) + eps). The sums of squares come from the GEMM that wrote x (the o_proj or down
// before it, which accumulated into the residual stream): its Store epilogue sums each row's stored
// values' squares per 16 columns (GemmFuse::ss_out, kStats), and this kernel adds those parts in a fixed
// order before its k loop (row_scales), so its k loop is the plain one. A row's factor depends on
// that row alone and on nothing M decides, so batch invariance holds. Not taken by default since session 26
// (DFLASH_GEMM_FOLD_NORM=MASK, cuda_backend.cu: a unit-weight norm kernel before the plain kernels measured
// faster); test_ops covers it either way.
//
// The family in files, so that nvcc compiles its ~250 kernel instantiations in parallel (as one TU they
// took two minutes): this header (everything device-side and the templates, in an anonymous namespace: each
// TU instantiates what it uses); one TU per kernel family (an epilogue and a fuse mode), gemv_<family>.cu
// (launch_<family>: launch_gemm<E, FUSE>, whose kernels are instantiated there and nowhere else;
// setup_<family>: their shared memory limits and occupancy, for device_facts), the two SwiGLU families in
// one TU (each alone compiles in half the time of the others); and gemv.cu (the host side: device facts,
// tilings, the ops.cuh entries, each handing its call to its family's launch; the two small kernels).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "ops.cuh"
#include "rope_head.cuh"

// DFLASH_GEMM_EXP (timing experiments only, 0 in every real build): bits that strip features from the
// ring-fed kernel so tools/gemm_chain_bench shows what each costs; results are then wrong.
#ifndef DFLASH_GEMM_EXP
#define DFLASH_GEMM_EXP 0
#endif
namespace dflash {
namespace cuda {
namespace {

// The phase probe (probe builds only, gemm_chain_bench --probe): gemm_stream_kernel's launches of the shape
// probe_gemm_select_<family> chose (N, K; each family's TU has its own table, DFLASH_GEMM_PROBE_ACCESSORS) stamp 0
// entry, 1 the ring's first chunks issued, 2 the wait returned, 3 the last k loop done, 4 the end. Thread 0 keeps
// the stamps in registers and reads the chosen shape only at the end (DFLASH_GEMM_PROBE_STORE), so the probe adds
// no load to the path it times.
constexpr int kGemmProbePoints = 5;
#ifdef DFLASH_PHASE_PROBE
DFLASH_PROBE_TABLE(g_probe_gemm);
__device__ int64_t g_probe_gemm_shape[2];
static_assert(kGemmProbePoints <= kProbeStamps, "a table row holds every point");
#define DFLASH_GEMM_PROBE(point)      \
    do {                              \
        probe_t[point] = probe_now(); \
    } while (0)
#define DFLASH_GEMM_PROBE_STORE()                                                                        \
    do {                                                                                                 \
        const unsigned probe_b_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);        \
        if (threadIdx.x == 0 && probe_b_ < unsigned(kProbeBlocks) && N == g_probe_gemm_shape[0] &&       \
            K == g_probe_gemm_shape[1])                                                                  \
            for (int p_ = 0; p_ < kGemmProbePoints; ++p_)                                                \
                g_probe_gemm[probe_b_ * kProbeStamps + p_] = probe_t[p_];                                \
    } while (0)
#else
#define DFLASH_GEMM_PROBE(point) \
    do {                         \
    } while (0)
#define DFLASH_GEMM_PROBE_STORE() \
    do {                          \
    } while (0)
#endif

constexpr int kExp = DFLASH_GEMM_EXP;
// kExpPlainRing: launches that would take x in the ring (XLoad::Ring8, Ring16) take the plain ring of weights
// instead (7 chunks a warp against Ring16's 3; x then as the register path loads it, or with kExpNoX not at all):
// against kExpNoX alone, what the ring's depth costs a 16-row GEMM. kExpRingCap5 / kExpRingCap4 (with
// kExpPlainRing): that plain ring capped at 5 / 4 chunks a warp, all 32 lanes issuing the weights (with kExpNoX:
// the depth a design taking x outside the cp.async groups, e.g. by the bulk engine, would leave the weights).
constexpr int kExpNoRowScales = 1, kExpNoStats = 2, kExpNoStore = 4, kExpNoX = 8, kExpNoFinish = 16,
              kExpNoWait = 32, kExpPlainRing = 64, kExpRingCap5 = 128, kExpRingCap4 = 256;

constexpr int kWarps = 8;     // per block: kWarps / ks column groups x ks k-slices
constexpr int kTileM = 16;    // rows per mma tile
constexpr int kChunk = 64;    // k per lane-quad step (4 mma k16 steps)

// When a ring-fed GEMM lets its successor launch (gemv.cu's pdl_trigger): at its start, once every block is
// past its k loop, or once every block has issued its last weight load.
enum class PdlTrigger : int { Early = 0, Late = 1, Issued = 2 };

// SwiGLU (ring-fed kernel only): w is the fused [gate; up] weight (N = 2 * pair); half of a block's
// column groups take gate columns, the other half the same up columns (pair later), and the block
// stores silu(gate) * up, each rounded to bf16 first as the GEMM + swiglu pair rounds them.
enum class Epilogue { Store, Logits, Argmax, SwiGLU };

// What a ring-fed kernel fuses (GemmFuse), a template argument so the plain kernels stay as they are:
// kPlain (accumulate is a runtime flag), kNorm (a folded norm: ss_in), kStats (Store: ss_out, the
// stored rows' sums of squares for the norming GEMM after it).
constexpr int kPlain = 0, kNorm = 1, kStats = 2;

struct ArgmaxPartial {
    float value;
    int32_t index;
};

constexpr int kNt = 2;        // n-tiles (8 columns each) per warp
constexpr int kStages = 4;       // chunks per warp ring (gemm_stream_kernel, row-major weights)
constexpr int kTiledStages = 7;  // the tiled kernel: 2 blocks per SM, so a deeper ring per warp
// A persistent launch (tiled only) keeps finish_tile's sums apart from the ring, which then holds the
// next column block's chunks: one chunk less, so two blocks still fit on an SM.
constexpr int kPersistStages = kTiledStages - 1;
constexpr int kRowBytes = kChunk * 2;               // a ring row: one chunk of a weight row, 8 pieces of 16 bytes
constexpr int kStageBytes = kNt * 8 * kRowBytes;    // one chunk of a warp's kNt * 8 weight rows
// Where piece `part` of ring row r lies: swizzled (part ^ r % 8), so the 8 lanes of a quad member q, which
// read rows g = 0..7 at the same pieces, hit 8 different bank groups, without padding the rows (the bytes
// saved deepen the ring: more weight bytes in flight per SM).
__device__ __forceinline__ int ring_offset(int r, int part) { return r * kRowBytes + ((part ^ (r & 7)) << 4); }

__device__ __forceinline__ float finish_logit(float v, float multiplier, float softcap) {
    v *= multiplier;
    if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
    return v;
}

// The 16 bf16 lane-quad member q loads of row `row` in the 64-wide chunk at c0 (k = c0 + q*16
// .. +15), as 8 words; zeros past K or for a row out of range. x and w use the same function, so
// both see the same relabelling of k. (Measured on the H200: this layout with 2 chunks in flight
// beat a split-halves layout (64 contiguous bytes per quad load) and 4 chunks in flight, by 1-5%.)
// kWeights: base is a weight (read-only loads); else an activation (load_act16 / load_act_u16).
template <bool kWeights>
__device__ __forceinline__ void load16(const bf16 *base, int64_t ld, int64_t row,
                                       bool row_ok, int64_t c0, int q, int64_t K, bool vectorized,
                                       uint32_t out[8]) {
    const int64_t k_lo = c0 + q * 16, k_hi = k_lo + 8;
    if (row_ok && vectorized && c0 + kChunk <= K) {
        const bf16 *r = base + row * ld;
        const uint4 v0 = kWeights ? __ldg(reinterpret_cast<const uint4 *>(r + k_lo)) : load_act16(r + k_lo);
        const uint4 v1 = kWeights ? __ldg(reinterpret_cast<const uint4 *>(r + k_hi)) : load_act16(r + k_hi);
        out[0] = v0.x, out[1] = v0.y, out[2] = v0.z, out[3] = v0.w;
        out[4] = v1.x, out[5] = v1.y, out[6] = v1.z, out[7] = v1.w;
        return;
    }
    const unsigned short *p = reinterpret_cast<const unsigned short *>(base + row * ld);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int64_t k0 = (i < 4 ? k_lo : k_hi) + 2 * (i & 3);
        uint32_t lo = 0u, hi = 0u;
        if (row_ok && k0 < K) lo = kWeights ? uint32_t(__ldg(p + k0)) : load_act_u16(p + k0);
        if (row_ok && k0 + 1 < K) hi = kWeights ? uint32_t(__ldg(p + k0 + 1)) : load_act_u16(p + k0 + 1);
        out[i] = lo | (hi << 16);
    }
}

// How the ring-fed kernel reads x: Element (load16's element path: any alignment), Masked (XRow:
// 16-byte loads, rows past M and halves past K zeroed), Full (plain 16-byte loads: M % 16 == 0 and
// K % 64 == 0, so nothing needs zeroing), Slice (tiled, M == 1: the warp's whole k slice of the row loaded
// into shared memory at once after griddepcontrol.wait, each chunk's x then read from there). They read the
// same values, so the sums are the same.
//
// Why Slice: x in registers is loaded two chunks ahead, so a warp's x loads go out one pair at a time
// behind its ring's refills, and at 1 row, where most of a slice's weights are already in the ring when
// the wait returns, the warp then runs at one x round trip per two chunks (session 21: the GEMM chain
// 0.28 ms faster at 1 row with no x loads at all; session 22: three or four register sets ahead did not
// help). One burst of loads per warp puts every x round trip of the slice into one.
// Ring8, Ring16 (tiled, M >= 2; where ring_x_choice says so): each ring stage holds a chunk's
// weights and its x rows (Ring8: rows g only, M <= 8; Ring16: the tile's 16), issued by cp.async with the
// weights (rows past M and halves past K zero-filled), so a chunk's x is in flight as long as its weights;
// the stages this takes leave the ring 4 (Ring8) or 3 (Ring16) chunks deep.
// RingBulk (tiled, not persistent, K % 64 == 0, sm_90+; DFLASH_GEMM_X_RING bit 16 where Ring16 would run): the
// weights in a plain ring of kBulkStages chunks, issued by all 32 lanes, and x through a ring of its own,
// kBulkXStages chunks a warp (copied kBulkXStages - 1 chunks ahead), filled by the bulk-copy engine (one 128-byte
// cp.async.bulk per row < M, completing on the stage's mbarrier), so no lane's cp.async groups wait on x and the
// weights keep 4 chunks in flight (session 44, H100, the 16-row chain without x loads: 4 chunks as fast as 7,
// Ring16's 3 cost 0.08 ms and its x loads 0.18). Rows past M are zeroed once (a bulk copy does not zero-fill); x
// is read into the same registers as Ring16 reads it, so the sums are the same. RingBulkFence (bits 16 + 32):
// the same with a proxy fence (fence.proxy.async) after each step's x reads, before a copy refills the stage.
// Session 45, H100, with 2 x stages and the fence: correct, and 11% slower (the 16-row chain 5.59 ms against
// 5.04), hence 3 stages, and the fence on its own switch (CUTLASS's TMA pipelines order a refill after the
// readers' barrier alone).
// RingTma (bits 16 + 64): x by one 2-D tensor copy a chunk (cp.async.bulk.tensor: the tile's 16 rows x 64 k,
// rows past M and k past K zero-filled by the copy, 128-byte swizzled as ring_offset swizzles), from one lane, into
// kTmaXStages stages a warp, 1024-byte aligned: a sixteenth of RingBulk's copies, for a chunk of lead less (its
// stages and their alignment fit the two blocks an SM with two stages, not three).
enum class XLoad { Element, Masked, Full, Slice, Slice2, Ring8, Ring16, RingBulk, RingBulkFence, RingTma };
constexpr int kBulkStages = 4, kBulkXStages = 3, kTmaXStages = 2;
constexpr int kTmaXStageBytes = kTileM * kRowBytes;
// A bulk x stage: the tile's even rows, 16 bytes, then its odd rows, so rows g and g + 1, which a quarter-warp
// reads at the same pieces, fall in different banks (a row's 128 bytes land as one copy: no swizzle).
constexpr int kBulkOddRows = 8 * kRowBytes + 16;
constexpr int kBulkXStageBytes = kBulkOddRows + 8 * kRowBytes;
__device__ __forceinline__ int bulk_x_offset(int r) { return (r & 1) * kBulkOddRows + (r >> 1) * kRowBytes; }

// XLoad::Slice (Slice2): the ring gives one (two) of its chunks to the x slices, kWarps slices of up to 16
// (32) chunks of one row (128 bytes a chunk), so two blocks still fit on an SM. SL: the ring chunks given.
// Each launch gives what its slice needs (session 23 on the H200, 36 layers of Qwen3-8B shapes at 1 row, x in
// registers -> slices: qkv alone 0.611 -> 0.533 ms (one stage), o_proj 0.420 -> 0.348 (one), down 0.960 ->
// 0.848 (two; 0.985x its floor), the chain 3.989 -> 3.78; with two stages everywhere qkv was 0.56).
constexpr int kSliceChunksPerStage = kStageBytes / kRowBytes;  // 16
template <XLoad XL>
__host__ __device__ constexpr int slice_stages() { return XL == XLoad::Slice ? 1 : XL == XLoad::Slice2 ? 2 : 0; }
// The x rows a ring stage holds where xr are asked for: none under kExpPlainRing. The kernel (ring_x_rows) and the
// launch's shared memory (ring_stages, slice_offset, whose XR the host passes as 8 or 16) both go through it.
__host__ __device__ constexpr int stage_x_rows(int xr) { return kExp & kExpPlainRing ? 0 : xr; }
template <XLoad XL>
__host__ __device__ constexpr int ring_x_rows() {
    return stage_x_rows(XL == XLoad::Ring8 ? 8 : XL == XLoad::Ring16 ? 16 : 0);
}
// XR: x rows per stage (ring_x_rows); the stages then fit in the bytes of the plain ring.
template <bool TILED, bool PERSIST = false, int SL = 0, int XR = 0>
__host__ __device__ constexpr int ring_stages() {
    constexpr int s = ((PERSIST ? kPersistStages : TILED ? kTiledStages : kStages) - SL) * kStageBytes /
                      (kStageBytes + stage_x_rows(XR) * kRowBytes);
    constexpr int cap = XR > 0 && (kExp & kExpPlainRing) ? (kExp & kExpRingCap4 ? 4 : kExp & kExpRingCap5 ? 5 : s) : s;
    return s < cap ? s : cap;
}

// A 16-byte aligned x row (K % 8 == 0) in the ring-fed kernel, read without divergence: a row
// past M reads the tile's first row (valid whenever the block runs: M > m0) and is zeroed, and an
// 8-element half past K (K % 8 == 0: halves are wholly in or out) reads the row's start and is
// zeroed, so every lane takes the same 16-byte path (the rows past M of a 1-row decode step
// otherwise send 7 of 8 lane groups down load16's element path).
struct XRow {
    const bf16 *row;  // the row, or row m0 for a row past M
    uint32_t keep;    // all ones for a row < M
    __device__ XRow(const bf16 *x, int64_t ldx, int64_t r, bool r_ok, int64_t m0)
        : row(x + (r_ok ? r : m0) * ldx), keep(r_ok ? 0xffffffffu : 0u) {}
    // Every row of the tile < M and every chunk whole (M % 16 == 0, K % 64 == 0): plain loads.
    __device__ __forceinline__ void load_full(int64_t c0, int q, uint32_t out[8]) const {
        const uint4 v0 = load_act16(row + c0 + q * 16);
        const uint4 v1 = load_act16(row + c0 + q * 16 + 8);
        out[0] = v0.x, out[1] = v0.y, out[2] = v0.z, out[3] = v0.w;
        out[4] = v1.x, out[5] = v1.y, out[6] = v1.z, out[7] = v1.w;
    }
    // The loads of a masked chunk (rows past M and halves past K read valid addresses), unmasked: mask() zeroes
    // them where x is used. (Masked as it lands, the AND waited for the load there: every chunk stalled the warp
    // one L2 round trip and x's two-chunk lead was lost. Session 27 on the H200: the persistent lm_head of a
    // propose's 15 rows streamed at 3.27 TB/s against 4.08 at 16 rows, Full.)
    __device__ __forceinline__ void load_raw(int64_t c0, int q, int64_t K, uint32_t out[8]) const {
        const int64_t k0 = c0 + q * 16, k1 = k0 + 8;
        const uint4 v0 = load_act16(row + (k0 < K ? k0 : 0));
        const uint4 v1 = load_act16(row + (k1 < K ? k1 : 0));
        out[0] = v0.x, out[1] = v0.y, out[2] = v0.z, out[3] = v0.w;
        out[4] = v1.x, out[5] = v1.y, out[6] = v1.z, out[7] = v1.w;
    }
    __device__ __forceinline__ void mask(int64_t c0, int q, int64_t K, uint32_t v[8]) const {
        const int64_t k0 = c0 + q * 16, k1 = k0 + 8;
        const uint32_t keep0 = k0 < K ? keep : 0u, keep1 = k1 < K ? keep : 0u;
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] &= keep0, v[4 + e] &= keep1;
    }
    __device__ __forceinline__ void load(int64_t c0, int q, int64_t K, uint32_t out[8]) const {
        load_raw(c0, q, K, out);
        mask(c0, q, K, out);
    }
};

// Where a warp works: grid = (ceil(M / 16), column blocks); block = kWarps warps; warp = group *
// KS + slice; a group owns kNt * 8 columns; a slice owns a contiguous run of k chunks. The row
// tiles vary fastest, so a column block's row tiles (prefill: M / 16 of them) run side by side and
// read its weights from DRAM once, the rest from L2 (x fastest is the launch order). A persistent
// launch (gemm_stream_kernel's PERSIST) has fewer blocks than column blocks and moves each block
// on to column block blockIdx.y + gridDim.y, ... (at()); the work of a column block is the same.
template <int KS>
struct WarpTile {
    static constexpr int kGroups = kWarps / KS;
    static constexpr int kCols = kNt * 8;                 // per group
    static constexpr int kBlockCols = kGroups * kCols;
    int lane, warp, group, slice, g, q;
    int64_t m0, col_block, col_blocks, col0, c_begin, c_end;

    __device__ WarpTile(int64_t K, int64_t blocks) {
        lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        group = warp / KS, slice = warp % KS;
        g = lane >> 2, q = lane & 3;
        m0 = int64_t(blockIdx.x) * kTileM;
        col_blocks = blocks;
        at<false>(blockIdx.y, 0);
        const int64_t chunks = (K + kChunk - 1) / kChunk;
        const int64_t per_slice = (chunks + KS - 1) / KS;
        c_begin = slice * per_slice, c_end = min(chunks, c_begin + per_slice);
    }
    // This warp's first column in column block cb. SWIGLU: groups [0, half) take gate columns, groups
    // [half, 2 half) the same up columns (pair later).
    template <bool SWIGLU>
    __device__ int64_t col0_of(int64_t cb, int64_t pair) const {
        if constexpr (SWIGLU) {
            constexpr int kHalf = kGroups / 2;
            const int64_t base = cb * kHalf * kCols;
            return group < kHalf ? base + group * kCols : pair + base + (group - kHalf) * kCols;
        } else {
            return cb * kBlockCols + group * kCols;
        }
    }
    template <bool SWIGLU>
    __device__ void at(int64_t cb, int64_t pair) {
        col_block = cb;
        col0 = col0_of<SWIGLU>(cb, pair);
    }
};

// One chunk of mma steps: acc[t] += x rows (x0: row g, x1: row g + 8) . weight n-tile t.
__device__ __forceinline__ void mma_chunk(float acc[kNt][4], const uint32_t x0[8],
                                          const uint32_t x1[8], const uint32_t wb[kNt][8]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const uint32_t a[4] = {x0[2 * s], x1[2 * s], x0[2 * s + 1], x1[2 * s + 1]};
#pragma unroll
        for (int t = 0; t < kNt; ++t)
            mma_bf16_16816(acc[t], a[0], a[1], a[2], a[3], wb[t][2 * s], wb[t][2 * s + 1]);
    }
}

// A folded norm (kNorm) takes its rows' sums of squares from the GEMM that wrote x (GemmFuse::ss_in:
// parts of 16 columns), not from its own k loop: summing them with two more mma per k step made the
// q/k/v and gate/up GEMMs 13-14% slower on the H200 (session 14). row_scale: the tile's factors
// rsqrt(sum / K + eps), one warp per row (lanes take parts lane, lane + 32, ..., then a butterfly: the same
// order for every row whatever M is); rows past M get 0 (never stored).
// The lane's parts of row m from p_first on (p_first, p_first + 32, ...), added to sum in that order, eight
// loads in flight before their adds (after pdl_wait; one round trip per 256 parts: at K 4096 the lane's share).
constexpr int kScaleBatch = 8;
__device__ __forceinline__ void add_ss_parts(const float *ss_in, int64_t m, int64_t parts, int64_t p_first,
                                             float &sum) {
    for (int64_t p0 = p_first; p0 < parts; p0 += 32 * kScaleBatch) {
        float v[kScaleBatch];
#pragma unroll
        for (int i = 0; i < kScaleBatch; ++i)
            v[i] = p0 + 32 * i < parts ? load_act_f32(ss_in + m * parts + p0 + 32 * i) : 0.f;
#pragma unroll
        for (int i = 0; i < kScaleBatch; ++i)
            if (p0 + 32 * i < parts) sum += v[i];
    }
}
__device__ __forceinline__ float row_scale_of(float sum, int64_t m, int64_t M, int64_t K, float eps) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    return m < M ? rsqrtf(sum / float(K) + eps) : 0.f;
}
__device__ __forceinline__ void row_scales(const float *ss_in, int64_t m0, int64_t M, int64_t K, float eps,
                                           float *row_scale) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t parts = ss_parts(K);
    for (int r = warp; r < kTileM; r += kWarps) {
        const int64_t m = m0 + r;
        float sum = 0.f;
        if (m < M) add_ss_parts(ss_in, m, parts, lane, sum);
        const float f = row_scale_of(sum, m, M, K, eps);
        if (lane == 0) row_scale[r] = f;
    }
}
// The same for a tile of one row (M == 1: the x slices), in two parts, so the caller can put the first loads
// in flight with its own: row_scales1_issue loads the lane's first kScaleBatch parts of row 0 (warp 0; at
// K 4096 the whole row), row_scales1_finish adds them and any further parts; rows 1.. get 0.
struct RowScaleLoads {
    float v[kScaleBatch];
};
__device__ __forceinline__ void row_scales1_issue(const float *ss_in, int64_t K, RowScaleLoads &l) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t parts = ss_parts(K);
#pragma unroll
    for (int i = 0; i < kScaleBatch; ++i)
        l.v[i] = warp == 0 && lane + 32 * i < parts ? load_act_f32(ss_in + lane + 32 * i) : 0.f;
}
__device__ __forceinline__ void row_scales1_finish(const float *ss_in, int64_t K, float eps, const RowScaleLoads &l,
                                                   float *row_scale) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t parts = ss_parts(K);
    if (warp == 0) {
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < kScaleBatch; ++i)
            if (lane + 32 * i < parts) sum += l.v[i];
        add_ss_parts(ss_in, 0, parts, lane + 32 * kScaleBatch, sum);
        const float f = row_scale_of(sum, 0, 1, K, eps);
        if (lane == 0) row_scale[0] = f;
    }
    for (int r = threadIdx.x + 1; r < kTileM; r += blockDim.x) row_scale[r] = 0.f;
}

// The end of both kernels, in two parts. stash_partials: each warp's per-slice sums into shared memory
// `red` ([KS][16][block cols] floats). finish_pass (after every warp's stash is visible): the slices
// added in order 0..KS-1 and stored (accumulate: added to y; kStats: and each row's sum of squares of
// the stored values per 16 columns, a half-warp butterfly), finished as logits, or reduced to per-block
// argmax partials; kNorm: scaled by the row's factor first (row_scale, in shared memory). finish_pass
// only reads `red`, so a persistent block can run it for one column block while other warps stash the
// next one elsewhere (gemm_stream_kernel's PERSIST). finish_tile: both, with a block barrier between.
template <int KS>
__device__ __forceinline__ float &red_at(float *red, int sl, int r, int cc) {
    return red[(sl * kTileM + r) * WarpTile<KS>::kBlockCols + cc];
}

template <int KS>
__device__ __forceinline__ void stash_partials(const WarpTile<KS> &wt, const float acc[kNt][4], float *red) {
    // c0, c1: row g, columns 2q, 2q+1 of the n-tile; c2, c3: row g + 8.
#pragma unroll
    for (int t = 0; t < kNt; ++t) {
        const int cc = wt.group * WarpTile<KS>::kCols + t * 8 + 2 * wt.q;
        red_at<KS>(red, wt.slice, wt.g, cc) = acc[t][0];
        red_at<KS>(red, wt.slice, wt.g, cc + 1) = acc[t][1];
        red_at<KS>(red, wt.slice, wt.g + 8, cc) = acc[t][2];
        red_at<KS>(red, wt.slice, wt.g + 8, cc + 1) = acc[t][3];
    }
}

// col_block: the column block whose partials `red` holds; m0 its row tile's first row.
template <int KS, Epilogue E, int FUSE = kPlain>
__device__ __forceinline__ void finish_pass(int64_t m0, int64_t col_block, int64_t col_blocks, float *red,
                                            int64_t M, int64_t N, bf16 *y, int64_t ldy, float multiplier,
                                            float softcap, float *logits_out, ArgmaxPartial *partial,
                                            int64_t pair, const float *row_scale, bool accumulate,
                                            float *ss_out) {
    constexpr int kBlockCols = WarpTile<KS>::kBlockCols;
    static_assert(kBlockCols % 16 == 0 && kTileM * kBlockCols % (kWarps * 32) == 0,
                  "ss_out's 16-column parts are aligned half-warps, and every thread runs every pass");
    // A value: the slices in order 0..KS-1, then the row's norm factor (kNorm).
    auto value = [&](int r, int cc) {
        float v = red_at<KS>(red, 0, r, cc);
#pragma unroll
        for (int sl = 1; sl < KS; ++sl) v += red_at<KS>(red, sl, r, cc);
        if constexpr (FUSE == kNorm) v *= row_scale[r];
        return v;
    };
    // Only the rows < M are stored; whole passes of the block's threads (the butterflies need every lane).
    constexpr int kThreads = kWarps * 32;
    const int rows = int(M - m0 < kTileM ? M - m0 : int64_t(kTileM));
    if constexpr (E == Epilogue::SwiGLU) {
        constexpr int kHalf = kBlockCols / 2;  // gate columns cc, their up columns cc + kHalf
        for (int i = threadIdx.x; i < rows * kHalf; i += kThreads) {
            const int r = i / kHalf, cc = i % kHalf;
            const int64_t m = m0 + r, n = col_block * kHalf + cc;
            if (n < pair)
                y[m * ldy + n] = to_bf16(swiglu_value(to_float(to_bf16(value(r, cc))),
                                                      to_float(to_bf16(value(r, cc + kHalf)))));
        }
    } else if constexpr (E == Epilogue::Argmax) {
        // One warp per row: lanes scan columns lane, lane+32, ... (increasing), then a butterfly
        // that keeps the lowest index on ties (torch.argmax).
        const int lane = threadIdx.x & 31;
        for (int r = threadIdx.x >> 5; r < rows; r += kWarps) {
            ArgmaxPartial b{-INFINITY, INT32_MAX};
            for (int cc = lane; cc < kBlockCols; cc += 32) {
                const int64_t n = col_block * kBlockCols + cc;
                const float v = finish_logit(value(r, cc), multiplier, softcap);
                if (n < N && (v > b.value || b.index == INT32_MAX)) b = {v, int32_t(n)};
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, b.value, o);
                const int32_t oi = __shfl_xor_sync(0xffffffffu, b.index, o);
                if (oi != INT32_MAX &&
                    (b.index == INT32_MAX || ov > b.value || (ov == b.value && oi < b.index)))
                    b = {ov, oi};
            }
            if (lane == 0) partial[(m0 + r) * col_blocks + col_block] = b;
        }
    } else {
        const int passes = (rows * kBlockCols + kThreads - 1) / kThreads;
        for (int p = 0; p < passes; ++p) {
            const int i = threadIdx.x + p * kThreads;
            const int r = i / kBlockCols, cc = i % kBlockCols;
            const float v = value(r, cc);
            const int64_t m = m0 + r, n = col_block * kBlockCols + cc;
            if constexpr (E == Epilogue::Store) {
                float stored = 0.f;
                if (!(kExp & kExpNoStore) && m < M && n < N) {
                    bf16 &out = y[m * ldy + n];
                    const bf16 o = accumulate ? to_bf16(to_float(out) + to_float(to_bf16(v))) : to_bf16(v);
                    out = o;
                    stored = to_float(o);
                }
                if constexpr (FUSE == kStats && !(kExp & kExpNoStats)) {  // the 16 lanes of a part hold one row's 16 columns
                    float sq = stored * stored;
#pragma unroll
                    for (int o = 8; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
                    if (cc % 16 == 0 && m < M && n < N) ss_out[m * ss_parts(N) + n / 16] = sq;
                }
            } else {  // Logits
                if (m < M && n < N) logits_out[m * N + n] = finish_logit(v, multiplier, softcap);
            }
        }
    }
}

template <int KS, Epilogue E, int FUSE = kPlain>
__device__ __forceinline__ void finish_tile(const WarpTile<KS> &wt, const float acc[kNt][4],
                                            float *red, int64_t M, int64_t N, bf16 *y, int64_t ldy,
                                            float multiplier, float softcap, float *logits_out,
                                            ArgmaxPartial *partial, int64_t pair = 0,
                                            const float *row_scale = nullptr, bool accumulate = false,
                                            float *ss_out = nullptr) {
    stash_partials<KS>(wt, acc, red);
    __syncthreads();
    finish_pass<KS, E, FUSE>(wt.m0, wt.col_block, wt.col_blocks, red, M, N, y, ldy, multiplier, softcap,
                             logits_out, partial, pair, row_scale, accumulate, ss_out);
}

template <int KS>
__host__ __device__ constexpr size_t red_bytes() {
    return size_t(KS) * kTileM * WarpTile<KS>::kBlockCols * sizeof(float);
}
// Dynamic shared memory of gemm_stream_kernel: the warps' rings, reused by finish_tile (PERSIST: the
// rings, then two buffers of partials, taken by column blocks in turn).
// SL (XLoad::Slice, Slice2): then the warps' x slices, from slice_offset.
template <int KS, bool TILED, bool PERSIST = false, int SL = 0, int XR = 0>
__host__ __device__ constexpr size_t slice_offset() {
    constexpr size_t ring =
        size_t(kWarps) * ring_stages<TILED, PERSIST, SL, XR>() * (kStageBytes + stage_x_rows(XR) * kRowBytes);
    return PERSIST ? ring + 2 * red_bytes<KS>() : ring > red_bytes<KS>() ? ring : red_bytes<KS>();
}
// XLoad::RingBulk, RingTma (TMA): the warps' weight rings (RING bytes a warp), then their x rings (RingTma: after up
// to 1024 bytes of room to align them), then the x stages' mbarriers (finish_tile reuses the rings as it does the
// plain ring's; red_bytes lies within the weight rings).
template <bool TMA, int RING>
__host__ __device__ constexpr size_t xring_bars_offset() {
    return TMA ? size_t(kWarps) * RING + 1024 + size_t(kWarps) * kTmaXStages * kTmaXStageBytes
               : size_t(kWarps) * (RING + kBulkXStages * kBulkXStageBytes);
}
template <int KS, bool TMA>
constexpr size_t xring_smem_bytes() {
    constexpr size_t bytes = xring_bars_offset<TMA, kBulkStages * kStageBytes>() +
                             size_t(kWarps) * (TMA ? kTmaXStages : kBulkXStages) * sizeof(uint64_t);
    static_assert(red_bytes<KS>() <= size_t(kWarps) * kBulkStages * kStageBytes, "finish_tile's partials in the rings");
    // two blocks an SM as the tiled kernel's (sm_90: 228 KB a multiprocessor, 1 KB of it reserved a block, and
    // at most 128 bytes of static shared memory: kNorm's scales)
    static_assert(2 * (bytes + 1024 + 128) <= 228 * 1024, "the x rings: two blocks an SM");
    return bytes;
}
template <int KS, bool TILED, bool PERSIST = false, int SL = 0, int XR = 0>
constexpr size_t stream_smem_bytes() {
    constexpr size_t bytes = slice_offset<KS, TILED, PERSIST, SL, XR>() + size_t(SL) * kWarps * kStageBytes;
    static_assert(bytes <= slice_offset<KS, TILED, PERSIST, 0>(),
                  "x slices in place of ring stages: the blocks per SM stay as they were");
    // kExpRingCap5/4: the capped ring in the plain ring's bytes, so the blocks per SM stay as they were
    if constexpr (XR > 0 && (kExp & kExpPlainRing) && (kExp & (kExpRingCap5 | kExpRingCap4)))
        return slice_offset<KS, TILED, PERSIST, 0>();
    return bytes;
}

// Register-fed: any alignment, any K. x: [M, ldx] bf16; w: [N, K] bf16.
template <int KS, Epilogue E>
__global__ void __launch_bounds__(kWarps * 32)
gemm_mma_kernel(const bf16 *x, int64_t M, int64_t ldx, const bf16 *__restrict__ w,
                int64_t N, int64_t K, bool vectorized, bf16 *y, int64_t ldy, float multiplier,
                float softcap, float *logits_out, ArgmaxPartial *partial) {
    pdl_prologue();
    __shared__ float red[KS * kTileM * WarpTile<KS>::kBlockCols];
    const WarpTile<KS> wt(K, gridDim.y);
    float acc[kNt][4] = {};
    const bool row0_ok = wt.m0 + wt.g < M, row1_ok = wt.m0 + wt.g + 8 < M;
#pragma unroll 2
    for (int64_t c = wt.c_begin; c < wt.c_end; ++c) {
        const int64_t c0 = c * kChunk;
        uint32_t wb[kNt][8];
#pragma unroll
        for (int t = 0; t < kNt; ++t) {
            const int64_t n = wt.col0 + t * 8 + wt.g;
            load16<true>(w, K, n, n < N, c0, wt.q, K, vectorized, wb[t]);
        }
        uint32_t x0[8], x1[8];
        load16<false>(x, ldx, wt.m0 + wt.g, row0_ok, c0, wt.q, K, vectorized, x0);
        load16<false>(x, ldx, wt.m0 + wt.g + 8, row1_ok, c0, wt.q, K, vectorized, x1);
        mma_chunk(acc, x0, x1, wb);
    }
    finish_tile<KS, E>(wt, acc, red, M, N, y, ldy, multiplier, softcap, logits_out, partial);
}

// The rope tail (RopeTail; launch_gemm takes it for a Store launch of one row tile, not persistent): after its
// stores, a block counts itself into its unit of columns (max(block columns, head_dim): a head, or the block's whole
// heads); the unit's last block to arrive norms and rotates the unit's q and k heads in place and writes its k and
// v heads to their cache slots, for rows m0.. of its tile, with rope.cu's arithmetic (rope_head.cuh), reading the
// stored bf16 through L2. Stores are made visible by the classic fence-then-count (threadFenceReduction).
template <int KS>
__device__ __forceinline__ void rope_tail(const RopeTail &t, int64_t col_block, int64_t m0, int64_t M, bf16 *y,
                                          int64_t ldy) {
    constexpr int kBlockCols = WarpTile<KS>::kBlockCols;
    const int unit_cols = max(kBlockCols, t.head_dim);
    const int per_unit = unit_cols / kBlockCols;  // blocks per unit
    const int64_t unit = col_block * kBlockCols / unit_cols;
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned prev = per_unit == 1 ? 0u : atomicAdd(&t.counters[unit], 1u);
        last = prev + 1 == unsigned(per_unit);
        if (last && per_unit > 1) t.counters[unit] = 0u;  // every block of the unit has counted
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int lane = threadIdx.x & 31, per_row = t.heads + 2 * t.kv_heads, heads_in_unit = unit_cols / t.head_dim;
    const int rows = int(M - m0 < kTileM ? M - m0 : int64_t(kTileM));
    const int64_t kv_width = int64_t(t.kv_heads) * t.head_dim;
    for (int item = threadIdx.x >> 5; item < rows * heads_in_unit; item += kWarps) {
        const int64_t row = m0 + item / heads_in_unit;
        const int h = int(unit * heads_in_unit) + item % heads_in_unit;
        if (h >= per_row) continue;  // past N (never: rope_tail_units asks for whole units)
        bf16 *v = y + row * ldy + int64_t(h) * t.head_dim;
        const int64_t slot = h >= t.heads ? int64_t(t.slots[row]) : 0;
        if (h < t.heads + t.kv_heads) {
            const bf16 *w = h < t.heads ? t.q_norm : t.k_norm;
            const LaneRope r = lane_rope(t.head_dim, w, float(t.positions[row]), t.inv_freq, t.attention_factor, lane);
            bf16 *copy = h < t.heads || slot < 0
                             ? nullptr
                             : t.k_cache + slot * kv_width + int64_t(h - t.heads) * t.head_dim;
            norm_rope_head<true>(v, t.head_dim, w != nullptr, t.eps, r, copy, lane);
        } else if (slot >= 0) {
            copy_head<true>(v, t.v_cache + slot * kv_width + int64_t(h - t.heads - t.kv_heads) * t.head_dim,
                            t.head_dim, lane);
        }
    }
}

// Ring-fed: 16-byte aligned x and w, K % 8 == 0, ldx % 8 == 0. Each warp streams its chunks
// through S ring slots (kStages; kTiledStages when TILED): the slot read at step i was filled
// S - 1 steps earlier, and the slot freed at step i - 1 is refilled at the top of step i, so S - 1
// chunks are in flight per warp (no block-wide barrier until the epilogue). x is read from L2/L1
// one chunk ahead.
//
// TILED: w is in the tiled layout (backend.hpp: 16-row x 64-column tiles, zero padded), so a
// warp's chunk is one contiguous 2 KB tile and its whole slice one contiguous run; x may then be
// any layout (XLoad::Element). Not TILED: w row-major, x 16-byte vectorized (Masked or Full).
// gemm_stream_body is the kernel, inlined into its two entries: gemm_stream_kernel, and gemm_stream_tma_kernel
// (XLoad::RingTma), whose x tensor map (xmap, nullptr for the other) is a kernel parameter of its own.
template <int KS, Epilogue E, bool TILED, XLoad XL, bool PERSIST, int FUSE>
__device__ __forceinline__ void
gemm_stream_body(const bf16 *x, int64_t M, int64_t ldx, const bf16 *__restrict__ w,
                 int64_t N, int64_t K, bf16 *y, int64_t ldy, float multiplier, float softcap,
                 float *logits_out, ArgmaxPartial *partial, int64_t pair, int trigger,
                 int64_t col_blocks, float norm_eps, bool accumulate, const float *ss_in, float *ss_out,
                 bool late_scales, const RopeTail &tail, const CUtensorMap *xmap) {
    // The next kernel may launch from here (its blocks then take SM slots this grid's later waves
    // could use), or (pdl_trigger: PdlTrigger) once every block is past its (last) k loop, or once every
    // block has issued its last weight load (fill_next below).
    const bool late_trigger = trigger == int(PdlTrigger::Late);
    bool issued_trigger = trigger == int(PdlTrigger::Issued);
    if (trigger == int(PdlTrigger::Early)) pdl_launch_dependents();
#ifdef DFLASH_PHASE_PROBE
    unsigned long long probe_t[kGemmProbePoints] = {};
#endif
    DFLASH_GEMM_PROBE(0);
    static_assert(kNt * 8 == kTileRows && kChunk == kTileCols, "a warp's chunk is one weight tile");
    static_assert(TILED || XL != XLoad::Element, "row-major weights come with vectorized x here");
    static_assert(!PERSIST || TILED, "persistent launches stream tiled weights");
    static_assert(FUSE != kNorm || E == Epilogue::Store || E == Epilogue::SwiGLU, "a folded norm feeds a GEMM or the MLP");
    static_assert(FUSE != kStats || E == Epilogue::Store, "only a store sums its rows' squares");
    constexpr bool kSwiGLU = E == Epilogue::SwiGLU;
    static_assert(!kSwiGLU || WarpTile<KS>::kGroups >= 2, "SwiGLU needs two column groups per block (ks <= 4)");
    constexpr int SL = slice_stages<XL>();
    constexpr bool kSlice = SL > 0;
    static_assert(!kSlice || TILED, "x slices: the tiled kernel (M == 1)");
    constexpr int XR = ring_x_rows<XL>();
    constexpr bool kRingX = XR > 0;
    static_assert(!kRingX || TILED, "x in the ring: the tiled kernel");
    constexpr bool kTma = XL == XLoad::RingTma;
    constexpr bool kBulk = XL == XLoad::RingBulk || XL == XLoad::RingBulkFence || kTma;
    constexpr int kXStages = kTma ? kTmaXStages : kBulkXStages;  // RingBulk, RingTma: the x ring's stages
    constexpr int kXStageBytes = kTma ? kTmaXStageBytes : kBulkXStageBytes;
    constexpr int kBulkLead = kXStages - 1;  // x chunks copied ahead of the one read
    static_assert(!kBulk || (TILED && !PERSIST), "bulk x: the tiled kernel, not persistent");
    constexpr bool kXRegs = !kSlice && !kRingX && !kBulk;  // x in registers (xa, xb)
    constexpr int kStage = kStageBytes + XR * kRowBytes;  // a ring stage: a chunk's weights, then its x rows
    constexpr int S = kBulk ? kBulkStages : ring_stages<TILED, PERSIST, SL, XR>();
    static_assert(S >= 3, "cp_async_wait<S - 2>: at least one chunk in flight past the one read");
    extern __shared__ __align__(16) unsigned char smem[];
    WarpTile<KS> wt(K, col_blocks);
    wt.template at<kSwiGLU>(blockIdx.y, pair);
    unsigned char *ring = smem + size_t(wt.warp) * S * kStage;
    const int64_t n_chunks = max(int64_t(0), wt.c_end - wt.c_begin);
    const int64_t k_chunks = (K + kChunk - 1) / kChunk;
    // This block's column blocks: blockIdx.y, + gridDim.y, ... (one unless PERSIST). Its warp's chunks
    // run through the ring as one sequence over them, so the next column block's weights stream in
    // while this one's sums are finished.
    const int64_t my_tiles = PERSIST ? (col_blocks - 1 - int64_t(blockIdx.y)) / gridDim.y + 1 : 1;
    const int64_t total = my_tiles * n_chunks;
    // PERSIST: column block t's partials go to buffer t % 2 (red + (t % 2) * red floats); full[b]
    // completes when every thread has stashed into buffer b, empty[b] when every thread's finish_pass
    // of it is done. A warp finishes column block t - 1 after stashing t, so no warp waits for another
    // except one whole column block behind (it replaced a block barrier per column block; session 21 on
    // the H200: gate/up alone the same, 1.96 ms, its epilogue still 0.18 ms of it).
    __shared__ uint64_t persist_bars[PERSIST ? 4 : 1];  // full[0], full[1], empty[0], empty[1]
    if constexpr (PERSIST) {
        if (threadIdx.x < 4) mbar_init(&persist_bars[threadIdx.x], kWarps * 32);
        __syncthreads();
    }

    // The warp's chunk sequence, filled in order (no division on the way): the next chunk to fill is chunk
    // fj of column block f_cb, into ring slot fs; f_col0 its first column.
    int64_t f_cb = blockIdx.y, f_col0 = wt.col0, f_j = 0, filled = 0;
    int fs = 0;
    // Ring8/16: chunk c0's x rows into the stage after its weights (x_ready: past griddepcontrol.wait).
    bool x_ready = false;
    auto fill_x = [&](unsigned char *slot, int64_t c0) {
        if constexpr (kExp & kExpNoX) return;  // x stays whatever the stage held (timing builds only)
#pragma unroll
        for (int i = 0; i < XR * 8 / 32; ++i) {
            const int p = wt.lane + 32 * i, r = p >> 3, part = p & 7;
            const int64_t row = wt.m0 + r, k = c0 + part * 8;
            const bool ok = row < M && k < K;
            cp_async16(slot + kStageBytes + ring_offset(r, part), ok ? x + row * ldx + k : x, ok);
        }
    };
    auto fill_next = [&]() {
        const int64_t c0 = (wt.c_begin + f_j) * kChunk;
        unsigned char *slot = ring + fs * kStage;
        const bool band_ok = f_col0 < N;  // a block's last groups may lie past N
        if constexpr (TILED) {  // one 2 KB tile (band col0 / 16, chunk c_begin + j): piece p at p * 16 bytes
            const bf16 *tile =
                w + (band_ok ? ((f_col0 / kTileRows) * k_chunks + wt.c_begin + f_j) * (kTileRows * kTileCols) : 0);
#pragma unroll
            for (int q = 0; q < kNt * 64 / 32; ++q) {
                const int p = wt.lane + 32 * q, r = p >> 3, part = p & 7;
                cp_async16(slot + ring_offset(r, part), band_ok ? tile + p * 8 : w, band_ok);
            }
        } else {
#pragma unroll
            for (int q = 0; q < kNt * 64 / 32; ++q) {
                const int p = wt.lane + 32 * q, r = p >> 3, part = p & 7;
                const int64_t n = f_col0 + r, k = c0 + part * 8;
                const bool ok = n < N && k < K;
                cp_async16(slot + ring_offset(r, part), ok ? w + n * K + k : w, ok);
            }
        }
        if constexpr (kRingX)
            if (x_ready) fill_x(slot, c0);
        ++filled;
        fs = fs + 1 == S ? 0 : fs + 1;
        if (PERSIST && ++f_j == n_chunks) {  // on to this block's next column block
            f_j = 0;
            f_cb += gridDim.y;
            f_col0 = wt.template col0_of<kSwiGLU>(f_cb, pair);
        } else if (!PERSIST) {
            ++f_j;
        }
    };
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
        if (filled < total) fill_next();
        cp_async_commit();  // empty groups keep the wait count uniform
    }
    // RingBulk: the warp's x ring (after every warp's weight ring), its stages' mbarriers, and the rows past M
    // zeroed in every stage (never copied to); bulk_rows rows of each chunk are copied, chunk i into stage
    // i % kBulkXStages, whose barrier's phase i / kBulkXStages it completes.
    // RingTma: the x rings from the first 1024-byte boundary past the weight rings; every chunk is a whole tile.
    unsigned char *xrings = smem + size_t(kWarps) * S * kStage;
    if constexpr (kTma) xrings += (1024u - unsigned(__cvta_generic_to_shared(xrings)) % 1024u) % 1024u;
    [[maybe_unused]] unsigned char *xring = xrings + size_t(wt.warp) * kXStages * kXStageBytes;
    [[maybe_unused]] uint64_t *xbar =
        reinterpret_cast<uint64_t *>(smem + xring_bars_offset<kTma, S * kStage>()) +
        wt.warp * kXStages;
    [[maybe_unused]] const int bulk_rows = kTma ? kTileM : int(M - wt.m0 < kTileM ? M - wt.m0 : kTileM);
    auto bulk_issue = [&](int64_t i, int stage) {  // chunk i's rows into `stage`; lane 0 has armed its barrier
        if constexpr (kTma) {
            if (wt.lane == 0)
                tma_load_2d(xring + stage * kXStageBytes, xmap, int((wt.c_begin + i) * kChunk), int(wt.m0),
                            &xbar[stage]);
        } else if (wt.lane < bulk_rows) {
            bulk_copy(xring + stage * kXStageBytes + bulk_x_offset(wt.lane),
                      x + (wt.m0 + wt.lane) * ldx + (wt.c_begin + i) * kChunk, kRowBytes, &xbar[stage]);
        }
    };
    if constexpr (kBulk) {
        if (wt.lane == 0) {
            for (int b = 0; b < kXStages; ++b) mbar_init(&xbar[b], 1);
            fence_bar_init();
        }
#pragma unroll
        for (int i = 0; i < (kTma ? 0 : kBulkXStages * kTileM * 8 / 32); ++i) {
            const int p = wt.lane + 32 * i, stage = p / (kTileM * 8), r = (p >> 3) % kTileM, part = p & 7;
            if (r >= bulk_rows)
                *reinterpret_cast<uint4 *>(xring + stage * kBulkXStageBytes + bulk_x_offset(r) + part * 16) =
                    make_uint4(0, 0, 0, 0);
        }
        __syncwarp();
    }
    // Every load of a warp whose whole sequence fits the ring's lead is issued already.
    if (issued_trigger && filled == total) {
        pdl_launch_dependents();
        issued_trigger = false;
    }
    DFLASH_GEMM_PROBE(1);
    // The weights never change: their first chunks stream in while the kernels before this one
    // finish (programmatic dependent launch, unless DFLASH_PDL=0); x is written by those kernels, so the
    // x loads wait.
    if constexpr (!(kExp & kExpNoWait)) pdl_wait();
    DFLASH_GEMM_PROBE(2);
    // Slice: the warp's k slice of row 0 (M == 1), all its loads in flight at once, into shared memory.
    unsigned char *xslice = smem + slice_offset<KS, TILED, PERSIST, SL>() + size_t(wt.warp) * SL * kStageBytes;
    // kNorm with slices, factors before the k loop: row 0's row_scales loads go out with the slice's, one round
    // trip instead of two (a slice means M == 1: the other rows get 0 without a load).
    [[maybe_unused]] RowScaleLoads early_scales;
    const bool scales_with_slice = kSlice && FUSE == kNorm && !(kExp & kExpNoRowScales) && !late_scales;
    if constexpr (kSlice) {
        constexpr int kPer = SL * kStageBytes / 16 / 32;  // 16-byte pieces per lane
        const int64_t k_lo = wt.c_begin * kChunk;
        const int n_pieces = int(n_chunks) * (kChunk / 8);
        uint4 v[kPer];
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
            const int p = wt.lane + 32 * i;
            const int64_t k = k_lo + int64_t(p) * 8;
            v[i] = p < n_pieces && k < K ? load_act16(x + k) : make_uint4(0, 0, 0, 0);
        }
        if (scales_with_slice) row_scales1_issue(ss_in, K, early_scales);
#pragma unroll
        for (int i = 0; i < kPer; ++i)
            if (wt.lane + 32 * i < n_pieces) *reinterpret_cast<uint4 *>(xslice + (wt.lane + 32 * i) * 16) = v[i];
        __syncwarp();
    }
    int64_t sj = 0;  // Slice: the slice's chunk of the step
    // Ring8/16: the x of the chunks filled before the wait (sequence positions 0.., slots 0..), one group;
    // the first step waits for every group (that one was issued last), the rest as before.
    bool first_step = true;
    if constexpr (kRingX) {
        for (int64_t i = 0; i < filled; ++i) fill_x(ring + i * kStage, (wt.c_begin + i % n_chunks) * kChunk);
        cp_async_commit();
        x_ready = true;
    }
    // RingBulk: bj the chunk consumed next, in stage bs, its phase's parity bpar; chunk bj + kBulkLead is copied
    // during its step, into the stage read the step before.
    int64_t bj = 0;
    int bs = 0;
    unsigned bpar = 0;
    if constexpr (kBulk) {
        if (wt.lane == 0)
            for (int i = 0; i < kBulkLead && i < total; ++i) bulk_expect(&xbar[i], unsigned(bulk_rows * kRowBytes));
        __syncwarp();
        for (int i = 0; i < kBulkLead && i < total; ++i) bulk_issue(i, i);
    }

    const bool row0_ok = wt.m0 + wt.g < M, row1_ok = wt.m0 + wt.g + 8 < M;
    // x rows: XRow's divergence-free loads when x is vectorized (every row-major launch); else load16.
    const XRow xr0(x, ldx, wt.m0 + wt.g, row0_ok, wt.m0), xr1(x, ldx, wt.m0 + wt.g + 8, row1_ok, wt.m0);
    const bool x1_rows = wt.m0 + 8 < M;  // some row g + 8 of the tile is < M
    auto load_x = [&](int r, int64_t c0, uint32_t out[8]) {  // r: 0 = row g, 1 = row g + 8
        if constexpr (kExp & kExpNoX) {
#pragma unroll
            for (int e = 0; e < 8; ++e) out[e] = 0x3c003c00u + uint32_t(c0);
        } else if constexpr (XL == XLoad::Full)
            (r ? xr1 : xr0).load_full(c0, wt.q, out);
        else if constexpr (XL == XLoad::Masked) {
            if (TILED && r == 1 && !x1_rows) {  // tiled: rows g + 8 all past M (a decode step): zeros, no loads
#pragma unroll
                for (int e = 0; e < 8; ++e) out[e] = 0u;
            } else if constexpr (TILED) {
                (r ? xr1 : xr0).load_raw(c0, wt.q, K, out);  // masked where used (mask_x)
            } else {  // one chunk ahead in 3 blocks' registers per SM: masked here (where used, it spilled)
                (r ? xr1 : xr0).load(c0, wt.q, K, out);
            }
        } else
            load16<false>(x, ldx, wt.m0 + wt.g + 8 * r, r ? row1_ok : row0_ok, c0, wt.q, K, false, out);
    };
    // x is read in sequence order too, the same k chunks in every column block: xj is the next x chunk.
    int64_t xj = 0, x_loaded = 0;
    // Masked: the chunk consumed next (the same sequence), whose x set mask_x zeroes past M and K before its mma.
    int64_t mj = 0;
    auto mask_x = [&](uint32_t (&xc)[2][8]) {
        if constexpr (XL == XLoad::Masked && TILED && !(kExp & kExpNoX)) {
            const int64_t c0 = (wt.c_begin + mj) * kChunk;
            xr0.mask(c0, wt.q, K, xc[0]);
            if (x1_rows) xr1.mask(c0, wt.q, K, xc[1]);  // else zeros already, never loaded
            mj = PERSIST && mj + 1 == n_chunks ? 0 : mj + 1;
        }
    };
    auto load_x_next = [&](uint32_t out[2][8]) {
        const int64_t c0 = (wt.c_begin + xj) * kChunk;
        load_x(0, c0, out[0]);
        load_x(1, c0, out[1]);
        ++x_loaded;
        xj = PERSIST && xj + 1 == n_chunks ? 0 : xj + 1;
    };
    // x in registers, ahead of the mma. The tiled kernel keeps two fixed register sets taken in turn (xa:
    // the even chunks of the sequence, xb: the odd ones), and the load of chunk i + 2 goes into the set
    // chunk i's mma has just read, so no register waits on a load to be moved (rotating the chunks
    // through the sets gave x one step to arrive, not two). Session 21 on the H200: verify 3% faster, the
    // GEMM chain the same at 1 row, where x loads still cost 0.28 ms (the chain with none). The row-major
    // kernel's register budget (3 blocks per SM) holds one chunk ahead: xa, and the next chunk loaded
    // before the mma.
    uint32_t xa[2][8] = {}, xb[2][8] = {};
    if (kXRegs && x_loaded < total) load_x_next(xa);
    if (kXRegs && TILED && x_loaded < total) load_x_next(xb);
    bool x_odd = false;  // PERSIST with an odd chunk count: this column block's first chunk is in xb
    float *red = PERSIST ? reinterpret_cast<float *>(smem + size_t(kWarps) * S * kStage)
                         : reinterpret_cast<float *>(smem);
    // kNorm: the rows' factors, read by finish_pass after a barrier (finish_tile's, or full[b]). Only the
    // epilogue reads them, so with late_scales (late_scales_at) they are computed after the k loop (a persistent
    // launch: its first column block's, while the ring streams the next one's chunks) instead of here, where
    // row_scales' round trip stalls every warp's stream right after the wait. The same sums either way.
    float *row_scale = nullptr;
    auto compute_scales = [&]() {
        if constexpr (FUSE == kNorm) {
            if constexpr (kExp & kExpNoRowScales) {
                if (threadIdx.x < kTileM) row_scale[threadIdx.x] = 1.f;
            } else {
                row_scales(ss_in, wt.m0, M, K, norm_eps, row_scale);
            }
        }
    };
    if constexpr (FUSE == kNorm) {
        __shared__ float scales[kTileM];
        row_scale = scales;
        if (scales_with_slice)
            row_scales1_finish(ss_in, K, norm_eps, early_scales, row_scale);
        else if (!late_scales)
            compute_scales();
    }
    int rs = 0;  // the ring slot read next
    for (int64_t t = 0; t < my_tiles; ++t) {
        if (PERSIST && t > 0) wt.template at<kSwiGLU>(blockIdx.y + t * gridDim.y, pair);
        float acc[kNt][4] = {};
        // One chunk: its weights from the ring (refilling the slot read last step) and its mma with x set
        // xc; the next x chunk due goes into xn (tiled: xc itself, after the mma; row-major: a fresh set,
        // before it).
        auto step = [&](uint32_t (&xc)[2][8], uint32_t (&xn)[2][8]) {
            if (kRingX && first_step) {  // the x of the chunks filled before the wait: the last group
                cp_async_wait<0>();
                first_step = false;
            } else {
                cp_async_wait<S - 2>();  // this lane's pieces of this chunk have landed
            }
            // RingBulk: the stage of chunk bj + kBulkLead (read the step before, its phase waited for by every lane
            // then) armed before the barrier below, its copies issued after it (no lane reads that stage any more)
            const bool bulk_next = kBulk && bj + kBulkLead < total;
            const int bulk_stage = bs == 0 ? kXStages - 1 : bs - 1;  // (bs + kBulkLead) % kXStages
            if (bulk_next && wt.lane == 0) bulk_expect(&xbar[bulk_stage], unsigned(bulk_rows * kRowBytes));
            __syncwarp();            // ... and every lane's; all are done reading the one before
            if (filled < total) {
                fill_next();  // into the slot read last step
                if (issued_trigger && filled == total) {  // this warp's last weight load is out
                    pdl_launch_dependents();
                    issued_trigger = false;
                }
            }
            cp_async_commit();
            if (bulk_next) bulk_issue(bj + kBulkLead, bulk_stage);

            uint32_t wb[kNt][8];
            const unsigned char *slot = ring + rs * kStage;
            rs = rs + 1 == S ? 0 : rs + 1;
#pragma unroll
            for (int nt = 0; nt < kNt; ++nt) {
                const int row = nt * 8 + wt.g;  // pieces 2q, 2q + 1: k = q*16 .. +15 of the chunk
                const uint4 v0 = *reinterpret_cast<const uint4 *>(slot + ring_offset(row, 2 * wt.q));
                const uint4 v1 = *reinterpret_cast<const uint4 *>(slot + ring_offset(row, 2 * wt.q + 1));
                wb[nt][0] = v0.x, wb[nt][1] = v0.y, wb[nt][2] = v0.z, wb[nt][3] = v0.w;
                wb[nt][4] = v1.x, wb[nt][5] = v1.y, wb[nt][6] = v1.z, wb[nt][7] = v1.w;
            }
            if constexpr (kSlice) {  // row 0 only: lanes g = 0 (pieces 2q, 2q + 1), the rest zeros
                const uint32_t keep = wt.g == 0 ? 0xffffffffu : 0u;
                const uint4 v0 = *reinterpret_cast<const uint4 *>(xslice + sj * kRowBytes + wt.q * 32);
                const uint4 v1 = *reinterpret_cast<const uint4 *>(xslice + sj * kRowBytes + wt.q * 32 + 16);
                xc[0][0] = v0.x & keep, xc[0][1] = v0.y & keep, xc[0][2] = v0.z & keep, xc[0][3] = v0.w & keep;
                xc[0][4] = v1.x & keep, xc[0][5] = v1.y & keep, xc[0][6] = v1.z & keep, xc[0][7] = v1.w & keep;
                sj = PERSIST && sj + 1 == n_chunks ? 0 : sj + 1;
            }
            if constexpr (kRingX) {  // rows g (and g + 8) of the stage's x: zeros past M and K as filled
                const unsigned char *xs = slot + kStageBytes;
#pragma unroll
                for (int r = 0; r < XR / 8; ++r) {
                    const uint4 v0 = *reinterpret_cast<const uint4 *>(xs + ring_offset(r * 8 + wt.g, 2 * wt.q));
                    const uint4 v1 = *reinterpret_cast<const uint4 *>(xs + ring_offset(r * 8 + wt.g, 2 * wt.q + 1));
                    xc[r][0] = v0.x, xc[r][1] = v0.y, xc[r][2] = v0.z, xc[r][3] = v0.w;
                    xc[r][4] = v1.x, xc[r][5] = v1.y, xc[r][6] = v1.z, xc[r][7] = v1.w;
                }
            }
            if constexpr (kBulk) {  // rows g and g + 8 of chunk bj's stage, once its copies have landed
                mbar_wait(&xbar[bs], bpar);
                const unsigned char *xs = xring + bs * kXStageBytes;
#pragma unroll
                for (int r = 0; r < 2; ++r) {  // RingTma: swizzled as the ring's weights (ring_offset)
                    const int rr = r * 8 + wt.g;
                    const unsigned char *row = xs + (kTma ? ring_offset(rr, 2 * wt.q) : bulk_x_offset(rr) + wt.q * 32);
                    const unsigned char *row1 = kTma ? xs + ring_offset(rr, 2 * wt.q + 1) : row + 16;
                    const uint4 v0 = *reinterpret_cast<const uint4 *>(row);
                    const uint4 v1 = *reinterpret_cast<const uint4 *>(row1);
                    xc[r][0] = v0.x, xc[r][1] = v0.y, xc[r][2] = v0.z, xc[r][3] = v0.w;
                    xc[r][4] = v1.x, xc[r][5] = v1.y, xc[r][6] = v1.z, xc[r][7] = v1.w;
                }
                if constexpr (XL == XLoad::RingBulkFence) fence_proxy_async();  // before the copy refilling it
                ++bj;
                if (++bs == kXStages) bs = 0, bpar ^= 1u;
            }
            if (kXRegs && !TILED && x_loaded < total) load_x_next(xn);
            mask_x(xc);
            mma_chunk(acc, xc[0], xc[1], wb);
            if (kXRegs && TILED && x_loaded < total) load_x_next(xn);
        };
        if constexpr (TILED) {
            auto run = [&](uint32_t (&x0)[2][8], uint32_t (&x1)[2][8]) {
                int64_t j = 0;
#pragma unroll 1
                for (; j + 2 <= n_chunks; j += 2) {
                    step(x0, x0);
                    step(x1, x1);
                }
                if (j < n_chunks) step(x0, x0);
            };
            if (PERSIST && x_odd)
                run(xb, xa);
            else
                run(xa, xb);
            if (PERSIST && (n_chunks & 1)) x_odd = !x_odd;
        } else {
            for (int64_t j = 0; j < n_chunks; ++j) {
                uint32_t nx[2][8] = {};
                step(xa, nx);
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int e = 0; e < 8; ++e) xa[r][e] = nx[r][e];
            }
        }
        if (t + 1 == my_tiles) DFLASH_GEMM_PROBE(3);
        if constexpr (kExp & kExpNoFinish) {  // keep the sums alive, store nothing real
            if (late_trigger && t + 1 == my_tiles) pdl_launch_dependents();
            if (acc[0][0] == 1234.5f && acc[1][3] == -1234.5f && y) y[0] = to_bf16(acc[0][1]);
        } else if constexpr (PERSIST) {
            constexpr int64_t kRedFloats = int64_t(red_bytes<KS>() / sizeof(float));
            const int b = int(t & 1);
            float *mine = red + b * kRedFloats, *prev = red + (b ^ 1) * kRedFloats;
            if (late_scales && t == 0) compute_scales();  // published by full[0]'s arrivals below
            if (t >= 2) mbar_wait(&persist_bars[2 + b], unsigned(t - 2) >> 1 & 1u);  // column block t - 2's pass
            stash_partials<KS>(wt, acc, mine);
            mbar_arrive(&persist_bars[b]);
            if (late_trigger && t + 1 == my_tiles) pdl_launch_dependents();
            if (t >= 1) {  // column block t - 1, whose partials every warp stashed one column block ago
                mbar_wait(&persist_bars[b ^ 1], unsigned(t - 1) >> 1 & 1u);
                finish_pass<KS, E, FUSE>(wt.m0, int64_t(blockIdx.y) + (t - 1) * gridDim.y, col_blocks, prev, M, N,
                                         y, ldy, multiplier, softcap, logits_out, partial, pair, row_scale,
                                         accumulate, ss_out);
                mbar_arrive(&persist_bars[2 + (b ^ 1)]);
            }
            if (t + 1 == my_tiles) {  // the last column block: once every warp has stashed it
                mbar_wait(&persist_bars[b], unsigned(t) >> 1 & 1u);
                finish_pass<KS, E, FUSE>(wt.m0, wt.col_block, col_blocks, mine, M, N, y, ldy, multiplier, softcap,
                                         logits_out, partial, pair, row_scale, accumulate, ss_out);
            }
        } else {
            if (late_scales) compute_scales();  // published by the barrier below
            cp_async_wait<0>();
            __syncthreads();  // every warp is done with its ring: finish_tile reuses the memory
            if (late_trigger) pdl_launch_dependents();
            finish_tile<KS, E, FUSE>(wt, acc, red, M, N, y, ldy, multiplier, softcap, logits_out, partial, pair,
                                     row_scale, accumulate, ss_out);
            if constexpr (E == Epilogue::Store)
                if (tail.counters) rope_tail<KS>(tail, wt.col_block, wt.m0, M, y, ldy);
        }
    }
    DFLASH_GEMM_PROBE(4);
    DFLASH_GEMM_PROBE_STORE();
}

template <int KS, Epilogue E, bool TILED, XLoad XL, bool PERSIST, int FUSE = kPlain>
__global__ void __launch_bounds__(kWarps * 32, TILED ? 2 : 3)
gemm_stream_kernel(const bf16 *x, int64_t M, int64_t ldx, const bf16 *__restrict__ w,
                   int64_t N, int64_t K, bf16 *y, int64_t ldy, float multiplier, float softcap,
                   float *logits_out, ArgmaxPartial *partial, int64_t pair, int trigger,
                   int64_t col_blocks, float norm_eps, bool accumulate, const float *ss_in, float *ss_out,
                   bool late_scales, const RopeTail tail) {
    static_assert(XL != XLoad::RingTma, "RingTma: gemm_stream_tma_kernel");
    gemm_stream_body<KS, E, TILED, XL, PERSIST, FUSE>(x, M, ldx, w, N, K, y, ldy, multiplier, softcap, logits_out,
                                                      partial, pair, trigger, col_blocks, norm_eps, accumulate,
                                                      ss_in, ss_out, late_scales, tail, nullptr);
}
template <int KS, Epilogue E, int FUSE = kPlain>
__global__ void __launch_bounds__(kWarps * 32, 2)
gemm_stream_tma_kernel(const bf16 *x, int64_t M, int64_t ldx, const bf16 *__restrict__ w,
                       int64_t N, int64_t K, bf16 *y, int64_t ldy, float multiplier, float softcap,
                       float *logits_out, ArgmaxPartial *partial, int64_t pair, int trigger,
                       int64_t col_blocks, float norm_eps, bool accumulate, const float *ss_in, float *ss_out,
                       bool late_scales, const RopeTail tail, const __grid_constant__ CUtensorMap xmap) {
    gemm_stream_body<KS, E, true, XLoad::RingTma, false, FUSE>(x, M, ldx, w, N, K, y, ldy, multiplier, softcap,
                                                               logits_out, partial, pair, trigger, col_blocks,
                                                               norm_eps, accumulate, ss_in, ss_out, late_scales,
                                                               tail, &xmap);
}

// Which fuse mode (FUSE) a call's GemmFuse needs: a folded norm, else the stored rows' sums, else plain.
inline int fuse_mode(const GemmFuse &fuse) { return fuse.norm_eps > 0.f ? kNorm : fuse.ss_out ? kStats : kPlain; }

}  // namespace

// What the family's TUs share from gemv.cu, defined there once (device_facts' cache, the functions' levers
// read once from the environment: one copy each, not one per TU).
//
// Per-device facts, read once: SM count and how many gemm_stream_kernel blocks fit on an SM
// (shared memory bound: kWarps rings of kStages chunks; the tiled kernel's, register bound).
// Setting the kernels' dynamic shared memory limits happens there too (setup_<family>), before any launch
// or capture.
struct DeviceFacts {
    int sms = 0, stream_blocks_per_sm = 0, tiled_blocks_per_sm = 0;  // tiled: up to 128 registers
    int persist_blocks_per_sm = 0;                                    // the persistent tiled kernel
    bool norm_ok = false;  // the folded-norm kernels are resident as the plain ones are (StreamOccupancy)
    bool bulk_ok = false;  // sm_90+: the bulk and tensor copy engine (XLoad::RingBulk, RingTma)
};
const DeviceFacts &device_facts();
int pdl_trigger(int64_t M, int64_t blocks, bool tiled);  // blocks: the launch's grid; tiled: its layout
unsigned persistent_blocks(int64_t col_blocks, int64_t row_tiles, int64_t M);
bool stream_enabled();
bool slice_enabled(bool persist);
// ring_x_choice: 0, or the x rows a ring stage holds (8: Ring8, 16: Ring16), or where Ring16 would run in a launch
// that is not persistent, x by the copy engine instead (launch_gemm falls back to Ring16 where it cannot):
constexpr int kXRingBulk = 32, kXRingBulkFence = 33, kXRingTma = 34;
int ring_x_choice(int64_t M, bool persist, bool norm);
bool x_tensor_map(CUtensorMap *map, const bf16 *x, int64_t M, int64_t ldx, int64_t K);
bool late_scales_at(bool persist);

// The tiling of an [N, K] weight: how many k slices (ks) share a column group's K. Blocks of
// 8 warps own kWarps / ks * 16 columns. A function of N, K, the weight's layout and the device
// only, never of M (that is what keeps verify logits equal to decode logits). Chosen to fill the
// resident block slots: a score of blocks / slots for one partial wave, and the last wave's fill
// beyond that (1.45 waves ran at 73% on the H200); fewer slices win unless more fill clearly better.
struct Tiling {
    int ks;
    int64_t block_cols() const { return int64_t(kWarps / ks) * kNt * 8; }
    unsigned blocks(int64_t N) const { return unsigned((N + block_cols() - 1) / block_cols()); }
};
Tiling tiling(int64_t N, int64_t K, bool tiled);
int swiglu_ks(int64_t pair, int64_t K, bool tiled);

// One call's operands, as launch_gemm takes them (partial: ArgmaxPartial *, whose type is each TU's own).
struct GemmArgs {
    const bf16 *x;  // [M, ldx] bf16
    int64_t M, ldx;
    const bf16 *w;  // [N, K] bf16, tiled (w_tiled) or row-major
    bool w_tiled;
    int64_t N, K;
    bf16 *y;  // Store, SwiGLU: [M, ldy] bf16
    int64_t ldy;
    float multiplier, softcap;
    float *logits_out;  // Logits: [M, N] fp32
    void *partial;      // Argmax: ArgmaxPartial [M, column blocks]
    cudaStream_t s;
    int64_t pair;  // SwiGLU: the intermediate size (N = 2 * pair)
    GemmFuse fuse;
    const RopeTail *tail = nullptr;  // Store: the rope tail asked for (launch_<family> returns whether it ran)
};

// Blocks of a family's gemm_stream_kernel<KS, E, TILED, XLoad::Masked, PERSIST, FUSE> resident per SM, for
// KS = 1, 2, 4, 8 (SwiGLU: 8 left 0), row-major, tiled and persistent (tiled).
struct StreamOccupancy {
    int row_major[4] = {}, tiled[4] = {}, persist[4] = {};
    bool operator==(const StreamOccupancy &o) const {
        return std::equal(row_major, row_major + 4, o.row_major) && std::equal(tiled, tiled + 4, o.tiled) &&
               std::equal(persist, persist + 4, o.persist);
    }
};

// The kernel families, in their TUs. launch_<family>: launch_gemm<E, FUSE> (gemv.cu picks the family:
// the epilogue, and fuse_mode for Store and SwiGLU). setup_<family> (device_facts, once per device, before
// any launch): the family's dynamic shared memory limits, and its occupancy where device_facts reads it.
bool launch_store(const GemmArgs &a);  // gemv_store.cu: Store, kPlain
StreamOccupancy setup_store();
bool launch_store_norm(const GemmArgs &a);  // gemv_store_norm.cu: Store, kNorm
StreamOccupancy setup_store_norm();
bool launch_store_stats(const GemmArgs &a);  // gemv_store_stats.cu: Store, kStats
StreamOccupancy setup_store_stats();
void launch_swiglu(const GemmArgs &a);  // gemv_swiglu.cu: SwiGLU, kPlain
StreamOccupancy setup_swiglu();
void launch_swiglu_norm(const GemmArgs &a);  // gemv_swiglu.cu: SwiGLU, kNorm
StreamOccupancy setup_swiglu_norm();
void launch_logits(const GemmArgs &a);  // gemv_logits.cu: Logits
void setup_logits();
void launch_argmax(const GemmArgs &a);  // gemv_argmax.cu: Argmax (its partials; gemv.cu reduces them)
void setup_argmax();

namespace {

// How many units the rope tail has in a launch of block_cols-column blocks over N columns, or 0 where it cannot run
// there (RopeTail, rope_tail): N the fused q/k/v row of the tail's heads, units of whole heads and column blocks.
inline int64_t rope_tail_units(int64_t block_cols, int64_t N, const RopeTail &t) {
    const int64_t hd = t.head_dim, unit = std::max(block_cols, hd);
    if (hd <= 0 || hd % 2 || hd > 64 * kMaxPairsPerLane || !t.counters) return 0;
    if (N != (int64_t(t.heads) + 2 * t.kv_heads) * hd) return 0;
    if (unit % hd || unit % block_cols || N % unit || N / unit > kRopeTailCounters) return 0;
    return N / unit;
}

// w_tiled: the tiled kernel (any x); else the ring-fed kernel where x and w are 16-byte
// vectorizable, the register-fed one otherwise. The row-major two run the same sums (one tiling);
// tiled weights have a tiling of their own (tiling(..., true)).
// SwiGLU: N = 2 * pair, the fused tiling (swiglu_ks, checked by the caller), ring-fed kernels only.
// fuse (Store and SwiGLU; the ring-fed kernels only, gemm_fuse_fits): a folded norm, accumulate.
// FUSE: the kernels' fuse mode, fuse_mode(fuse) (the family's TU instantiates one).
// tail (Store): the rope tail where the launch takes it (one row tile, not persistent, the ring-fed kernel, units
// of whole column blocks: rope_tail_units); returns whether it did.
template <Epilogue E, int FUSE>
bool launch_gemm(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t N, int64_t K,
            bf16 *y, int64_t ldy, float multiplier, float softcap, float *logits_out,
            ArgmaxPartial *partial, cudaStream_t s, int64_t pair, GemmFuse fuse, const RopeTail *tail) {
    static_assert(FUSE == kPlain || (FUSE == kNorm && (E == Epilogue::Store || E == Epilogue::SwiGLU)) ||
                      (FUSE == kStats && E == Epilogue::Store),
                  "norms feed GEMMs and the MLP, sums come from stores");
    const bool x_vec = K % 8 == 0 && ldx % 8 == 0 && aligned16(x);
    const bool vectorized = x_vec && aligned16(w);
    const bool stream = vectorized && stream_enabled();
    if (w_tiled && !tiled_gemm_supported())
        fail(DFLASH_STATUS_INTERNAL, "a tiled GEMM weight on a device without the tiled kernel");
    constexpr bool kSwiGLU = E == Epilogue::SwiGLU;
    const Tiling t = kSwiGLU ? Tiling{swiglu_ks(pair, K, w_tiled)} : tiling(N, K, w_tiled);
    if (kSwiGLU && (t.ks == 0 || !(w_tiled || stream)))
        fail(DFLASH_STATUS_INTERNAL, "gemm_swiglu: no fused tiling for ", pair, " x ", K);
    const unsigned col_blocks = kSwiGLU ? unsigned(pair / (t.block_cols() / 2)) : t.blocks(N);
    if (col_blocks > 65535u)
        fail(DFLASH_STATUS_NOT_SUPPORTED, "gemm: ", col_blocks, " column blocks for N = ", N,
             " (a grid holds 65535)");
    const dim3 grid(unsigned((M + kTileM - 1) / kTileM), col_blocks);
    const unsigned persist = w_tiled && x_vec ? persistent_blocks(col_blocks, grid.x, M) : 0;
    if ((fuse.any() || fuse.ss_out) && !(w_tiled || stream))
        fail(DFLASH_STATUS_INTERNAL, "gemm: a fused norm / accumulate without the ring-fed kernel");
    if (fuse.accumulate && E != Epilogue::Store) fail(DFLASH_STATUS_INTERNAL, "gemm: only a store accumulates");
    if (fuse.norm_eps > 0.f && !device_facts().norm_ok)
        fail(DFLASH_STATUS_INTERNAL, "gemm: folded-norm kernels do not fit as the plain ones (norm_ok)");
    if (fuse.norm_eps > 0.f && !fuse.ss_in)
        fail(DFLASH_STATUS_INTERNAL, "gemm: a folded norm needs its rows' sums of squares (GemmFuse::ss_in)");
    if (fuse.ss_out && E != Epilogue::Store) fail(DFLASH_STATUS_INTERNAL, "gemm: only a store writes ss_out");
    if (fuse.norm_eps > 0.f && fuse.ss_out) fail(DFLASH_STATUS_INTERNAL, "gemm: a norming GEMM that also sums");
    if (fuse_mode(fuse) != FUSE)
        fail(DFLASH_STATUS_INTERNAL, "gemm: fuse mode ", fuse_mode(fuse), " launched as ", FUSE);
    // The tail's units: max(block columns, head_dim), a whole number of heads and of column blocks, and N a whole
    // number of them; one counter each.
    const bool take_tail = E == Epilogue::Store && tail && grid.x == 1 && !persist && (w_tiled || stream) &&
                           rope_tail_units(t.block_cols(), N, *tail) > 0;
    const RopeTail tail_arg = take_tail ? *tail : RopeTail{};
    auto go = [&](auto ks) {
        constexpr int KS = decltype(ks)::value;
        if constexpr (kSwiGLU && KS == 8) {
            return;  // never chosen (swiglu_ks)
        } else if (w_tiled || stream) {
            const bool full = M % kTileM == 0 && K % kChunk == 0;
            // sl: x slices (tiled, one row, x vectorized): the ring stages a warp's k slice needs, 1 or 2
            const int64_t per_slice = ((K + kChunk - 1) / kChunk + KS - 1) / KS;
            // The persistent SwiGLU keeps x in registers (session 23 on the H200: gate/up alone 1.995 ms, with
            // slices of one or two ring stages 2.10; the persistent lm_head's argmax gains from its slices:
            // decode 0.6%, at ctx 8192 1%), so its persistent slice kernels are not built.
            constexpr bool kPersistSlices = !kSwiGLU;
            const bool slice_ok = w_tiled && x_vec && M == 1 && (!persist || kPersistSlices) && slice_enabled(persist != 0);
            int sl = slice_ok ? int((per_slice + kSliceChunksPerStage - 1) / kSliceChunksPerStage) : 0;
            if (sl > 2) sl = 0;  // a slice past 32 chunks: x in registers
            // xr: x in the ring (Ring8 / Ring16; ring_x_choice), bulk: Ring16's launch with x by bulk copies
            // where whole chunks (K % 64 == 0) and the device (sm_90+) allow, tma: by tensor copies (sm_90+); else
            // Ring16 (ring_x_choice never asks for the copy engine in a persistent launch)
            int xr = w_tiled && x_vec ? ring_x_choice(M, persist != 0, FUSE == kNorm) : 0;
            const bool tma = xr == kXRingTma && device_facts().bulk_ok;
            const bool bulk = (xr == kXRingBulk || xr == kXRingBulkFence) && K % kChunk == 0 && device_facts().bulk_ok;
            const bool bulk_fence = xr == kXRingBulkFence;
            if (xr >= kXRingBulk) xr = 16;
            CUtensorMap xmap;  // RingTma: where the driver encodes none, Ring16 as before
            if (tma && x_tensor_map(&xmap, x, M, ldx, K)) {
                launch(gemm_stream_tma_kernel<KS, E, FUSE>, grid, kWarps * 32, xring_smem_bytes<KS, true>(), s, x, M, ldx, w,
                       N, K, y, ldy, multiplier, softcap, logits_out, partial, pair,
                       pdl_trigger(M, int64_t(grid.x) * grid.y * grid.z, true),
                       int64_t(col_blocks), fuse.norm_eps, fuse.accumulate, fuse.ss_in, fuse.ss_out,
                       FUSE == kNorm && late_scales_at(false), tail_arg, xmap);
                return;
            }
            constexpr XLoad kF = XLoad::Full, kM = XLoad::Masked, kS = XLoad::Slice, kS2 = XLoad::Slice2,
                            kR8 = XLoad::Ring8, kR16 = XLoad::Ring16;
            decltype(&gemm_stream_kernel<KS, E, true, kM, true, FUSE>) persist_slice = nullptr;  // where sl > 0
            if constexpr (kPersistSlices)
                persist_slice = sl == 1 ? gemm_stream_kernel<KS, E, true, kS, true, FUSE>
                                        : gemm_stream_kernel<KS, E, true, kS2, true, FUSE>;
            auto *kernel = persist  ? (sl        ? persist_slice
                                       : xr == 8  ? gemm_stream_kernel<KS, E, true, kR8, true, FUSE>
                                       : xr == 16 ? gemm_stream_kernel<KS, E, true, kR16, true, FUSE>
                                       : full     ? gemm_stream_kernel<KS, E, true, kF, true, FUSE>
                                                  : gemm_stream_kernel<KS, E, true, kM, true, FUSE>)
                           : !w_tiled ? (full ? gemm_stream_kernel<KS, E, false, kF, false, FUSE>
                                              : gemm_stream_kernel<KS, E, false, kM, false, FUSE>)
                           : sl == 1  ? gemm_stream_kernel<KS, E, true, kS, false, FUSE>
                           : sl == 2  ? gemm_stream_kernel<KS, E, true, kS2, false, FUSE>
                           : bulk     ? (bulk_fence ? gemm_stream_kernel<KS, E, true, XLoad::RingBulkFence, false, FUSE>
                                                    : gemm_stream_kernel<KS, E, true, XLoad::RingBulk, false, FUSE>)
                           : xr == 8  ? gemm_stream_kernel<KS, E, true, kR8, false, FUSE>
                           : xr == 16 ? gemm_stream_kernel<KS, E, true, kR16, false, FUSE>
                           : x_vec    ? (full ? gemm_stream_kernel<KS, E, true, kF, false, FUSE>
                                              : gemm_stream_kernel<KS, E, true, kM, false, FUSE>)
                                      : gemm_stream_kernel<KS, E, true, XLoad::Element, false, FUSE>;
            // persist: tiled with vectorized x (persistent_blocks' caller), one wave of blocks
            const size_t smem = persist   ? (sl == 1   ? stream_smem_bytes<KS, true, true, 1>()
                                             : sl == 2 ? stream_smem_bytes<KS, true, true, 2>()
                                             : xr == 8 ? stream_smem_bytes<KS, true, true, 0, 8>()
                                             : xr == 16 ? stream_smem_bytes<KS, true, true, 0, 16>()
                                                       : stream_smem_bytes<KS, true, true>())
                                : sl == 1 ? stream_smem_bytes<KS, true, false, 1>()
                                : sl == 2 ? stream_smem_bytes<KS, true, false, 2>()
                                : bulk    ? xring_smem_bytes<KS, false>()
                                : xr == 8 ? stream_smem_bytes<KS, true, false, 0, 8>()
                                : xr == 16 ? stream_smem_bytes<KS, true, false, 0, 16>()
                                : w_tiled ? stream_smem_bytes<KS, true>()
                                          : stream_smem_bytes<KS, false>();
            const dim3 launched = persist ? dim3(grid.x, persist) : grid;
            launch(kernel, launched, kWarps * 32, smem, s, x, M, ldx, w, N, K, y, ldy, multiplier, softcap, logits_out,
                   partial, pair, pdl_trigger(M, int64_t(launched.x) * launched.y * launched.z, w_tiled),
                   int64_t(col_blocks),
                   fuse.norm_eps, fuse.accumulate, fuse.ss_in, fuse.ss_out,
                   FUSE == kNorm && late_scales_at(persist != 0), tail_arg);
        } else if constexpr (!kSwiGLU && FUSE == kPlain) {
            launch(gemm_mma_kernel<KS, E>, grid, kWarps * 32, 0, s, x, M, ldx, w, N, K, vectorized, y, ldy,
                   multiplier, softcap, logits_out, partial);
        }
    };
    using std::integral_constant;
    switch (t.ks) {
        case 1: go(integral_constant<int, 1>{}); break;
        case 2: go(integral_constant<int, 2>{}); break;
        case 4: go(integral_constant<int, 4>{}); break;
        default: go(integral_constant<int, 8>{}); break;
    }
    return take_tail;
}

// A family's launch_<family>.
template <Epilogue E, int FUSE>
bool launch_family(const GemmArgs &a) {
    return launch_gemm<E, FUSE>(a.x, a.M, a.ldx, a.w, a.w_tiled, a.N, a.K, a.y, a.ldy, a.multiplier, a.softcap,
                                a.logits_out, static_cast<ArgmaxPartial *>(a.partial), a.s, a.pair, a.fuse, a.tail);
}

template <int KS, Epilogue E, int FUSE = kPlain>
void allow_stream_smem() {
    for (auto kernel : {gemm_stream_kernel<KS, E, false, XLoad::Masked, false, FUSE>,
                        gemm_stream_kernel<KS, E, false, XLoad::Full, false, FUSE>})
        DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(stream_smem_bytes<KS, false>())));
    for (auto kernel : {gemm_stream_kernel<KS, E, true, XLoad::Masked, false, FUSE>,
                        gemm_stream_kernel<KS, E, true, XLoad::Full, false, FUSE>,
                        gemm_stream_kernel<KS, E, true, XLoad::Element, false, FUSE>})
        DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(stream_smem_bytes<KS, true>())));
    auto allow = [](auto *kernel, size_t bytes) {
        DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    };
    allow(gemm_stream_kernel<KS, E, true, XLoad::Slice, false, FUSE>, stream_smem_bytes<KS, true, false, 1>());
    allow(gemm_stream_kernel<KS, E, true, XLoad::Slice2, false, FUSE>, stream_smem_bytes<KS, true, false, 2>());
    if constexpr (E != Epilogue::SwiGLU) {  // launch_gemm's kPersistSlices
        allow(gemm_stream_kernel<KS, E, true, XLoad::Slice, true, FUSE>, stream_smem_bytes<KS, true, true, 1>());
        allow(gemm_stream_kernel<KS, E, true, XLoad::Slice2, true, FUSE>, stream_smem_bytes<KS, true, true, 2>());
    }
    allow(gemm_stream_kernel<KS, E, true, XLoad::Ring8, false, FUSE>, stream_smem_bytes<KS, true, false, 0, 8>());
    allow(gemm_stream_kernel<KS, E, true, XLoad::Ring16, false, FUSE>, stream_smem_bytes<KS, true, false, 0, 16>());
    allow(gemm_stream_kernel<KS, E, true, XLoad::Ring8, true, FUSE>, stream_smem_bytes<KS, true, true, 0, 8>());
    allow(gemm_stream_kernel<KS, E, true, XLoad::Ring16, true, FUSE>, stream_smem_bytes<KS, true, true, 0, 16>());
    allow(gemm_stream_kernel<KS, E, true, XLoad::RingBulk, false, FUSE>, xring_smem_bytes<KS, false>());
    allow(gemm_stream_kernel<KS, E, true, XLoad::RingBulkFence, false, FUSE>, xring_smem_bytes<KS, false>());
    allow(gemm_stream_tma_kernel<KS, E, FUSE>, xring_smem_bytes<KS, true>());
    for (auto kernel : {gemm_stream_kernel<KS, E, true, XLoad::Masked, true, FUSE>,
                        gemm_stream_kernel<KS, E, true, XLoad::Full, true, FUSE>})
        DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(stream_smem_bytes<KS, true, true>())));
}

// A family's limits: every KS it launches (SwiGLU: ks <= 4, swiglu_ks).
template <Epilogue E, int FUSE>
void allow_family_smem() {
    allow_stream_smem<1, E, FUSE>();
    allow_stream_smem<2, E, FUSE>();
    allow_stream_smem<4, E, FUSE>();
    if constexpr (E != Epilogue::SwiGLU) allow_stream_smem<8, E, FUSE>();
}

// Blocks of gemm_stream_kernel<KS, E, TILED, Masked, PERSIST, FUSE> resident per SM.
template <int KS, bool TILED, bool PERSIST, Epilogue E = Epilogue::Store, int FUSE = kPlain>
int stream_occupancy() {
    int blocks = 0;
    DFLASH_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, gemm_stream_kernel<KS, E, TILED, XLoad::Masked, PERSIST, FUSE>, kWarps * 32,
        stream_smem_bytes<KS, TILED, PERSIST>()));
    return blocks;
}

// A family's setup_<family> where device_facts reads its occupancy: the limits, then the StreamOccupancy.
template <Epilogue E, int FUSE>
StreamOccupancy setup_family() {
    allow_family_smem<E, FUSE>();
    StreamOccupancy o;
    auto count = [&](auto ks, int i) {
        constexpr int KS = decltype(ks)::value;
        o.row_major[i] = stream_occupancy<KS, false, false, E, FUSE>();
        o.tiled[i] = stream_occupancy<KS, true, false, E, FUSE>();
        o.persist[i] = stream_occupancy<KS, true, true, E, FUSE>();
    };
    using std::integral_constant;
    count(integral_constant<int, 1>{}, 0);
    count(integral_constant<int, 2>{}, 1);
    count(integral_constant<int, 4>{}, 2);
    if constexpr (E != Epilogue::SwiGLU) count(integral_constant<int, 8>{}, 3);
    return o;
}

}  // namespace

// A family TU's probe accessors (probe builds only): probe_table_gemm_<family> (out nullptr zeroes the TU's table,
// else it is read into out; returns the stamps per row) and probe_gemm_select_<family> (the shape that stamps).
#ifdef DFLASH_PHASE_PROBE
#define DFLASH_GEMM_PROBE_ACCESSORS(family)                                             \
    int probe_table_gemm_##family(std::vector<unsigned long long> *out) {               \
        return probe_table_io(g_probe_gemm, out);                                       \
    }                                                                                   \
    void probe_gemm_select_##family(int64_t n, int64_t k) {                             \
        const int64_t shape[2] = {n, k};                                                \
        DFLASH_CUDA_CHECK(cudaMemcpyToSymbol(g_probe_gemm_shape, shape, sizeof shape)); \
    }
#else
#define DFLASH_GEMM_PROBE_ACCESSORS(family)
#endif

}  // namespace cuda
}  // namespace dflash
