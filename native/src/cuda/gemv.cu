// gemv.cu: the small-M GEMM family's host side (the kernels and the design notes: gemv_kernels.cuh): the
// per-device facts, the tilings, when a launch triggers its dependents, persists or streams, and the entries
// of ops.cuh, each handing its call to its kernel family's TU (gemv_<family>.cu), so that no kernel template
// is instantiated here; and the two small kernels, tile_weight_kernel and argmax_reduce_kernel.
#include "gemv_kernels.cuh"

namespace dflash {
namespace cuda {

const DeviceFacts &device_facts() {
    static DeviceFacts cached[64];
    int device = 0;
    DFLASH_CUDA_CHECK(cudaGetDevice(&device));
    static DeviceFacts fallback{132, 0};
    if (device < 0 || device >= 64) return fallback;
    DeviceFacts &f = cached[device];
    if (f.sms == 0) {
        int n = 0;
        DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
        const StreamOccupancy store = setup_store(), store_norm = setup_store_norm(),
                              store_stats = setup_store_stats(), swiglu = setup_swiglu(),
                              swiglu_norm = setup_swiglu_norm();
        setup_logits();
        setup_argmax();
        f.stream_blocks_per_sm = store.row_major[3];  // ks 8
        f.tiled_blocks_per_sm = store.tiled[3];
        f.persist_blocks_per_sm = store.persist[3];
        // The fused kernels (kNorm, kStats) are as resident as the plain ones the tilings were scored
        // with, every ks and layout.
        f.norm_ok = store_norm == store && store_stats == store && swiglu_norm == swiglu;
        int major = 0;
        DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        f.bulk_ok = major >= 9;
        f.sms = n > 0 ? n : 132;
    }
    return f;
}

namespace {
// Blocks of the ring-fed GEMM resident at once, one wave: SMs x blocks per SM of the layout's kernel (ks 8).
int64_t wave_slots(bool tiled) {
    const DeviceFacts &f = device_facts();
    return int64_t(f.sms) * std::max(1, tiled ? f.tiled_blocks_per_sm : f.stream_blocks_per_sm);
}
}  // namespace

// When the ring-fed GEMM lets the next kernel launch (PdlTrigger, gemv_kernels.cuh): at its start (early), once
// every block is past its k loop (late), so early dependents take no slots from its later blocks, or once every
// block has issued its last weight load (issued: the ring still holds S - 1 chunks to consume, so the next
// kernel is launched by the time this one's blocks exit and its blocks take their slots at once, streaming their
// first chunks while this kernel's last blocks finish). DFLASH_PDL_TRIGGER=early, late or issued forces one; the
// default (auto) is issued for calls of more than one row and early for one. Measured on the H100 (session 35,
// bench.py --variants, against auto = late for more than one row): issued made verify 2.1%, the 8B propose 2.4%,
// the 4B propose 2.8% and the ctx-8192 propose 3.5% faster, decode 1.3% slower (early stays for one row; session
// 12 on the H200: late had made verify and propose about 2% faster than early, decode 2% slower).
// DFLASH_PDL_TRIGGER=fit (session 47; session 48 on the H100, gemm_chain_bench's 16-row chain, 2 rounds: 8B shapes
// 0.999x, 4B 1.005x the time of auto, so not the default; an A/B switch for the H200): early wherever the
// launch's `blocks` fit one wave of its layout (wave_slots(tiled)), where no block of its own waits for a slot an
// early dependent could take, else auto's choice. A function of M and the launch's shape, and it only moves when
// the next kernel's blocks are scheduled, never what they read: a row's sums never depend on it. Read once.
int pdl_trigger(int64_t M, int64_t blocks, bool tiled) {
    static const int mode = [] {  // -1 auto, -3 fit, else a PdlTrigger; -2 a bad value
        const char *v = std::getenv("DFLASH_PDL_TRIGGER");
        if (!v || !*v || std::string(v) == "auto") return -1;
        if (std::string(v) == "fit") return -3;
        if (std::string(v) == "early") return int(PdlTrigger::Early);
        if (std::string(v) == "late") return int(PdlTrigger::Late);
        return std::string(v) == "issued" ? int(PdlTrigger::Issued) : -2;
    }();
    if (mode == -2)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "DFLASH_PDL_TRIGGER=", std::getenv("DFLASH_PDL_TRIGGER"),
             " (auto, fit, early, late or issued)");
    if (mode >= 0) return mode;
    if (mode == -3 && blocks <= wave_slots(tiled)) return int(PdlTrigger::Early);
    return int(M > 1 ? PdlTrigger::Issued : PdlTrigger::Early);
}

// Blocks of a persistent launch of `col_blocks` column blocks and `row_tiles` row tiles (a call of M rows):
// fewer column blocks than that (each block then takes col_blocks / blocks of them, balanced), or 0 where one
// wave holds the grid (nothing to gain) or DFLASH_GEMM_PERSIST=MASK leaves the call out (1: one-row calls,
// 2: calls of more rows; anything but 0-3 fails naming the variable). Default 0 since session 37: on the H100
// every run of sessions 35-37 (seven) timed verify and the proposes 0.7-2% faster without it, and session 35 had
// already taken one-row calls out (decode 4.2% faster). Session 13 on the H200 had measured the persistent launches
// 3-6% faster, before the issued trigger and the x rings: re-measure there. The sums are the same either way: a
// column block's work does not depend on the block that does it (so the choice may follow M).
unsigned persistent_blocks(int64_t col_blocks, int64_t row_tiles, int64_t M) {
    static const EnvInt mask = env_int("DFLASH_GEMM_PERSIST", 0, 0, 3);
    const bool on = (env_value(mask, "DFLASH_GEMM_PERSIST", "is not a mask of 1 (one-row calls) and 2 (more rows)") &
                     (M > 1 ? 2 : 1)) != 0;
    const DeviceFacts &f = device_facts();
    const int64_t per_row_tile = int64_t(f.sms) * f.persist_blocks_per_sm / std::max<int64_t>(1, row_tiles);
    if (!on || per_row_tile < 1 || col_blocks <= per_row_tile) return 0;
    const int64_t waves = (col_blocks + per_row_tile - 1) / per_row_tile;
    return unsigned((col_blocks + waves - 1) / waves);
}

// The ring-fed kernel is the default; DFLASH_GEMM_STREAM=0 runs the register-fed one everywhere
// (same tiling, same results: an A/B switch for benchmarks).
bool stream_enabled() {
    static const bool on = env_switch_on("DFLASH_GEMM_STREAM");
    return on && device_facts().stream_blocks_per_sm > 0;
}

// One-row tiled GEMMs read x from shared memory slices (XLoad::Slice, Slice2); DFLASH_GEMM_X_SLICE=0 keeps x
// in registers there too, DFLASH_GEMM_X_SLICE_PERSIST=0 in persistent launches (same sums: A/B switches for
// benchmarks).
bool slice_enabled(bool persist) {
    static const bool on = env_switch_on("DFLASH_GEMM_X_SLICE"), on_persist = env_switch_on("DFLASH_GEMM_X_SLICE_PERSIST");
    return on && (!persist || on_persist);
}

// Tiled GEMMs of 2 rows or more issue x with the weights, in the ring's stages (XLoad::Ring8 where M <= 8,
// Ring16 past that). DFLASH_GEMM_X_RING=MASK picks where: 1 Ring8, 2 Ring16 in plain launches without a folded
// norm, 4 Ring16 in plain launches with one (kNorm), 8 Ring16 in persistent launches (15 everywhere, 0
// nowhere). 3 is what won on the H200 (session 24, gemm_chain_bench over 36 layers): at 7 rows
// every GEMM faster (the chain 4.216 -> 3.999 ms); at 16 rows o_proj 0.467 -> 0.422 and down 1.054 -> 0.971,
// but q/k/v (kNorm) 0.646 -> 0.821 and the persistent gate/up 2.069 -> 2.568; verify 5.238 -> 5.091 ms (run 6).
// Bit 16: where Ring16 runs in a launch that is not persistent, x by the bulk-copy engine instead (XLoad::RingBulk:
// kXRingBulk here; with bit 32 too RingBulkFence, with bit 64 RingTma; launch_gemm falls back to Ring16 where the
// device is older than sm_90, for RingBulk where K % 64 != 0, for RingTma where the driver encodes no tensor map).
// The default, 83 (3 + 16 + 64: RingTma where Ring16 ran), since session 45 (H100, gemm_chain_bench, 36 layers, 16
// rows: the chain 5.032-5.044 -> 4.979-4.993 ms, down 1.271-1.278 -> 1.251-1.252; bench.py: verify 0.982x,
// propose 4B 0.978x); RingBulk's 128-byte row copies were 11-13% slower (=19: 5.69 ms; 5.34 at 9 rows, so the
// copies' count, not their lead or the proxy fence (=51: the same), is what costs).
// A value that is not a mask (0 to 127) fails every call, as DFLASH_ATTN_FILL does.
int ring_x_choice(int64_t M, bool persist, bool norm) {
    static const EnvInt setting = env_int("DFLASH_GEMM_X_RING", 83, 0, 127);
    const int64_t mask = env_value(setting, "DFLASH_GEMM_X_RING", "is not a mask (0 to 127)");
    if (M < 2) return 0;
    if (M <= 8) return mask & 1 ? 8 : 0;
    const int bit = persist ? 8 : norm ? 4 : 2;
    if (!(mask & bit)) return 0;
    if (!(mask & 16) || persist) return 16;
    return mask & 64 ? kXRingTma : mask & 32 ? kXRingBulkFence : kXRingBulk;
}

// RingTma's x operand: rows of K bf16 at x (ldx apart, 16-byte aligned), boxes of 16 rows x 64 k, 128-byte
// swizzled, zero-filled past M and K. The driver's encoder comes through the runtime (no libcuda link); false where
// the driver has none or refuses the shape.
bool x_tensor_map(CUtensorMap *map, const bf16 *x, int64_t M, int64_t ldx, int64_t K) {
    using Encode = CUresult (*)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    static const Encode encode = [] {
        void *fn = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
        const cudaError_t e =
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
        const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
        if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
            fn = nullptr;
            (void)cudaGetLastError();  // not left for the next launch's check to report
        }
        return reinterpret_cast<Encode>(fn);
    }();
    if (!encode) return false;
    const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(M)}, strides[1] = {cuuint64_t(ldx) * sizeof(bf16)};
    const cuuint32_t box[2] = {cuuint32_t(kChunk), cuuint32_t(kTileM)}, steps[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16 *>(x), dims, strides, box, steps,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Where a folded norm's row factors are computed (gemm_stream_kernel's late_scales): after the k loop, not
// before it, where row_scales' round trip holds up every warp's stream right after the wait.
// DFLASH_GEMM_LATE_SCALES=MASK: 1 in persistent launches (after the first column block's k loop, while the ring
// streams the next one's chunks), 2 in the others (after the k loop, before the epilogue's barrier); 0 before
// the k loop everywhere. The sums are the same either way. The default, 1, is what won on the H200 (session 25
// run 1, gemm_chain_bench --only, 36 layers, before the loop -> after it): the persistent gate/up
// 2.068-2.074 -> 2.015-2.017 ms at 16 rows, 1.981-1.986 -> 1.948-1.951 at 1 row; the plain q/k/v lost with 2
// (a round trip on the tail instead: 0.534 -> 0.585 ms at 1 row, 0.641 -> 0.670 at 7, 0.647-0.657 -> 0.675 at
// 16). A value that is not a mask (0 to 3) fails every call.
bool late_scales_at(bool persist) {
    static const EnvInt setting = env_int("DFLASH_GEMM_LATE_SCALES", 1, 0, 3);
    const int64_t mask = env_value(setting, "DFLASH_GEMM_LATE_SCALES", "is not a mask (0 to 3)");
    return (mask & (persist ? 1 : 2)) != 0;
}

namespace {

// The k-split (1, 2, 4, 8, at most max_ks) whose grid best fills the resident block slots of the
// layout; a larger ks must beat the best so far by 0.02 of a wave, and slices of under two chunks
// only add reduce work. blocks(ks): that tiling's block count, or < 0 where it cannot serve. 0 when
// no ks can.
template <class Blocks>
int best_ks(int64_t K, bool tiled, int max_ks, Blocks blocks) {
    const double slots = double(wave_slots(tiled));
    const int64_t chunks = (K + kChunk - 1) / kChunk;
    int best = 0;
    double best_score = -1.0;
    for (int ks : {1, 2, 4, 8}) {
        if (ks > max_ks || (ks > 1 && chunks < 2 * ks)) break;
        const double b = blocks(ks);
        if (b < 0) continue;
        const double score = b <= slots ? b / slots : b / (std::ceil(b / slots) * slots);
        if (score > best_score + 0.02) best = ks, best_score = score;
    }
    return best;
}

}  // namespace

Tiling tiling(int64_t N, int64_t K, bool tiled) {
    return Tiling{best_ks(K, tiled, 8, [&](int ks) { return double(Tiling{ks}.blocks(N)); })};
}

// The fused GEMM + SwiGLU's tiling: ks <= 4 (a block needs a gate and an up column group) and
// pair (the intermediate size) a multiple of the block's gate columns; 0 where none fits. Scored
// as tiling() scores, over pair / (block_cols / 2) blocks. A function of pair, K and the layout.
int swiglu_ks(int64_t pair, int64_t K, bool tiled) {
    return best_ks(K, tiled, 4, [&](int ks) {
        const int64_t half_cols = Tiling{ks}.block_cols() / 2;
        return pair % half_cols ? -1.0 : double(pair / half_cols);
    });
}

bool tiled_gemm_supported() { return stream_enabled() && device_facts().tiled_blocks_per_sm > 0; }

bool fused_norm_supported() { return stream_enabled() && device_facts().norm_ok; }

namespace {
// Whether a call of this layout runs on the ring-fed kernel: tiled weights, or 16-byte vectorizable x
// and w with the kernel enabled.
bool ring_fed_fits(const bf16 *x, int64_t ldx, const bf16 *w, bool w_tiled, int64_t K) {
    if (w_tiled) return tiled_gemm_supported();
    return K % 8 == 0 && ldx % 8 == 0 && aligned16(x) && aligned16(w) && stream_enabled();
}
}  // namespace

bool gemm_fuse_fits(const bf16 *x, int64_t ldx, const bf16 *w, bool w_tiled, int64_t K) {
    return fused_norm_supported() && ring_fed_fits(x, ldx, w, w_tiled, K);
}

// dst[tiled_elements(N, K)] = src[N, K] in the tiled layout, zeros in the padding.
__global__ void tile_weight_kernel(const bf16 *src, int64_t N, int64_t K, int64_t chunks, int64_t total,
                                   bf16 *dst) {
    pdl_prologue();
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t tile = i / (kTileRows * kTileCols), in = i % (kTileRows * kTileCols);
        const int64_t n = tile / chunks * kTileRows + in / kTileCols;
        const int64_t k = tile % chunks * kTileCols + in % kTileCols;
        dst[i] = n < N && k < K ? src[n * K + k] : __float2bfloat16_rn(0.f);
    }
}

void tile_weight(const bf16 *src, int64_t N, int64_t K, bf16 *dst, cudaStream_t s) {
    const int64_t total = tiled_elements(N, K);
    if (total == 0) return;
    const unsigned blocks = unsigned(std::min<int64_t>((total + 255) / 256, 65535));
    launch(tile_weight_kernel, blocks, 256, 0, s, src, N, K, (K + kChunk - 1) / kChunk, total, dst);
}

void gemm(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t N, int64_t K,
          bf16 *y, int64_t ldy, cudaStream_t s, GemmFuse fuse, const RopeTail *tail) {
    if (M == 0 || N == 0) return;
    if (fuse.any() && !gemm_fuse_fits(x, ldx, w, w_tiled, K))
        fail(DFLASH_STATUS_INTERNAL, "gemm: fused norm / accumulate where gemm_fuse_fits says no");
    const GemmArgs a{x, M, ldx, w, w_tiled, N, K, y, ldy, 1.f, 0.f, nullptr, nullptr, s, 0, fuse, tail};
    bool tail_done = false;
    switch (fuse_mode(fuse)) {
        case kNorm: tail_done = launch_store_norm(a); break;
        case kStats: tail_done = launch_store_stats(a); break;
        default: tail_done = launch_store(a); break;
    }
    if (tail && !tail_done) qkv_norm_rope_write(y, ldy, M, *tail, s);  // the launch did not take it
}

bool gemm_swiglu(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, bool w_tiled, int64_t inter, int64_t K,
                 bf16 *out, int64_t ldo, cudaStream_t s, GemmFuse fuse) {
    if (fuse.accumulate || fuse.ss_out) fail(DFLASH_STATUS_INTERNAL, "gemm_swiglu neither accumulates nor sums");
    if (!ring_fed_fits(x, ldx, w, w_tiled, K) || swiglu_ks(inter, K, w_tiled) == 0) return false;
    if (fuse.norm_eps > 0.f && (!fuse.ss_in || !fused_norm_supported())) return false;
    if (M == 0 || inter == 0) return true;
    const GemmArgs a{x, M, ldx, w, w_tiled, 2 * inter, K, out, ldo, 1.f, 0.f, nullptr, nullptr, s, inter, fuse};
    if (fuse_mode(fuse) == kNorm)
        launch_swiglu_norm(a);
    else
        launch_swiglu(a);
    return true;
}

void logits(const bf16 *x, int64_t M, const bf16 *w, bool w_tiled, int64_t V, int64_t K,
            float multiplier, float softcap, float *out, cudaStream_t s) {
    if (M == 0) return;
    launch_logits({x, M, K, w, w_tiled, V, K, nullptr, 0, multiplier, softcap, out, nullptr, s, 0, {}});
}

// An upper bound whatever the tiling: every block owns at least 8 columns.
size_t logits_argmax_scratch_bytes(int64_t M, int64_t V) {
    return size_t(M) * size_t((V + 7) / 8) * sizeof(ArgmaxPartial);
}

namespace {

// partial: [M, blocks]; one block per row; ties keep the lowest index (torch.argmax).
__global__ void argmax_reduce_kernel(const ArgmaxPartial *partial, int64_t blocks, int32_t *tokens) {
    pdl_prologue();
    __shared__ ArgmaxPartial best[256];
    const ArgmaxPartial *row = partial + int64_t(blockIdx.x) * blocks;
    ArgmaxPartial b{-INFINITY, INT32_MAX};
    // Increasing index per thread, kBatch loads in flight at once (one at a time, a 2374-block lm_head's
    // partials took ~9 dependent L2 round trips per thread: 6 us of a step's critical path on the H200).
    constexpr int kBatch = 16;
    for (int64_t base = threadIdx.x; base < blocks; base += int64_t(kBatch) * blockDim.x) {
        ArgmaxPartial c[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int64_t i = base + int64_t(u) * blockDim.x;
            c[u] = i < blocks ? row[i] : ArgmaxPartial{-INFINITY, INT32_MAX};
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
            if (c[u].index != INT32_MAX && (c[u].value > b.value || b.index == INT32_MAX)) b = c[u];
    }
    best[threadIdx.x] = b;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const ArgmaxPartial o = best[threadIdx.x + stride];
            ArgmaxPartial &m = best[threadIdx.x];
            if (o.index != INT32_MAX &&
                (m.index == INT32_MAX || o.value > m.value || (o.value == m.value && o.index < m.index)))
                m = o;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) tokens[blockIdx.x] = best[0].index;
}

}  // namespace

void logits_argmax(const bf16 *x, int64_t M, const bf16 *w, bool w_tiled, int64_t V, int64_t K,
                   float multiplier, float softcap, void *partial, int32_t *tokens,
                   cudaStream_t s) {
    if (M == 0) return;
    auto *p = static_cast<ArgmaxPartial *>(partial);
    launch_argmax({x, M, K, w, w_tiled, V, K, nullptr, 0, multiplier, softcap, nullptr, p, s, 0, {}});
    launch(argmax_reduce_kernel, unsigned(M), 256, 0, s, p, tiling(V, K, w_tiled).blocks(V), tokens);
}

}  // namespace cuda
}  // namespace dflash

