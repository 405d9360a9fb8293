// sampling.cu: temperature / top-k / top-p probabilities, inverse-CDF sampling, and the greedy
// and rejection-sampling verification, all on the device so a step copies back two integers.
//
// One block of 1024 threads per row. Instead of sorting a 150k vocabulary, top-k and top-p
// find their threshold by bisection over the order-preserving bit pattern of the values (32
// counting passes), then resolve ties at the threshold in index order with a block scan, the
// same order the host backend's stable sort gives. Draws walk each thread's contiguous chunk
// after an exclusive scan of the chunk sums. Uniforms come from philox.hpp, shared with the host.
#include "ops.cuh"
#include "../philox.hpp"

namespace dflash {
namespace cuda {
namespace {

constexpr int kThreads = 1024;

// Order-preserving map of a float to uint32 (larger float -> larger key).
__device__ __forceinline__ uint32_t order_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum over the block in thread order; `total` gets the sum. scratch: 32 floats.
__device__ float block_exclusive_scan(float v, float *scratch, float *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float inclusive = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += up;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        float w = lane < warps ? scratch[lane] : 0.f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float up = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += up;
        }
        if (lane < warps) scratch[lane] = w;  // inclusive scan of warp totals
    }
    __syncthreads();
    const float warp_prefix = warp > 0 ? scratch[warp - 1] : 0.f;
    *total = scratch[warps - 1];
    return warp_prefix + inclusive - v;
}

struct Chunk {
    int64_t begin, end;
};

__device__ __forceinline__ Chunk my_chunk(int64_t n) {
    const int64_t per = (n + blockDim.x - 1) / blockDim.x;
    const int64_t begin = min(n, int64_t(threadIdx.x) * per);
    return {begin, min(n, begin + per)};
}

// The index drawn by inverse CDF with uniform u over weights weight(v) >= 0 (v in [0, n)):
// the first v whose inclusive cumulative sum exceeds u * total; the last positive weight if
// rounding leaves none. All threads return the same index.
template <typename Weight>
__device__ int32_t block_draw(int64_t n, float u, Weight weight, float *scratch, int32_t *shared_pick) {
    const Chunk c = my_chunk(n);
    float mine = 0.f;
    int32_t last_positive = -1;
    for (int64_t v = c.begin; v < c.end; ++v) {
        const float w = weight(v);
        if (w > 0.f) {
            mine += w;
            last_positive = int32_t(v);
        }
    }
    float total;
    const float prefix = block_exclusive_scan(mine, scratch, &total);
    if (threadIdx.x == 0) *shared_pick = INT32_MAX;
    __syncthreads();
    const float target = u * total;
    if (mine > 0.f && prefix <= target && target < prefix + mine) {
        float cumulative = prefix;
        for (int64_t v = c.begin; v < c.end; ++v) {
            const float w = weight(v);
            if (w <= 0.f) continue;
            cumulative += w;
            if (cumulative > target) {
                atomicMin(shared_pick, int32_t(v));
                break;
            }
        }
    }
    __syncthreads();
    if (*shared_pick == INT32_MAX) {  // rounding: take the last positive weight
        const float best = block_max(float(last_positive), scratch);
        __syncthreads();
        if (threadIdx.x == 0) *shared_pick = int32_t(best);
        __syncthreads();
    }
    const int32_t pick = *shared_pick;
    __syncthreads();
    return pick;
}

// Count (or mass) of elements whose key is >= `threshold`.
__device__ float count_at_least(const float *row, int64_t n, uint32_t threshold, bool mass,
                                float *scratch) {
    float acc = 0.f;
    for (int64_t v = threadIdx.x; v < n; v += blockDim.x)
        if (order_key(row[v]) >= threshold) acc += mass ? row[v] : 1.f;
    return block_sum(acc, scratch);
}

// The largest key K with f(K) >= goal, where f(K) = count/mass of elements with key >= K.
__device__ uint32_t bisect_threshold(const float *row, int64_t n, bool mass, float goal,
                                     float *scratch) {
    uint32_t k = 0;
    for (int bit = 31; bit >= 0; --bit) {
        const uint32_t candidate = k | (1u << bit);
        if (count_at_least(row, n, candidate, mass, scratch) >= goal) k = candidate;
    }
    return k;
}

// Keeps, among the elements equal to the threshold, those (in index order) for which
// keep_more(amount before them) holds; zeroes the others and everything below the threshold.
// amount: count (mass = false) or probability mass (mass = true) of equal elements before.
template <typename KeepMore>
__device__ void cut_at_threshold(float *row, int64_t n, uint32_t threshold, bool mass,
                                 float fill, KeepMore keep_more, float *scratch) {
    const Chunk c = my_chunk(n);
    float mine = 0.f;
    for (int64_t v = c.begin; v < c.end; ++v)
        if (order_key(row[v]) == threshold) mine += mass ? row[v] : 1.f;
    float total;
    float before = block_exclusive_scan(mine, scratch, &total);
    for (int64_t v = c.begin; v < c.end; ++v) {
        const uint32_t key = order_key(row[v]);
        if (key > threshold) continue;
        if (key == threshold) {
            const float amount = mass ? row[v] : 1.f;
            if (keep_more(before)) {
                before += amount;
                continue;
            }
            before += amount;
        }
        row[v] = fill;
    }
    __syncthreads();
}

__global__ void __launch_bounds__(kThreads)
sampling_probs_kernel(float *rows, int64_t vocab, float temperature, float top_p, int32_t top_k) {
    pdl_prologue();
    __shared__ float scratch[32];
    float *row = rows + int64_t(blockIdx.x) * vocab;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) row[v] = row[v] / temperature;
    __syncthreads();
    if (top_k > 0 && top_k < vocab) {
        const uint32_t kth = bisect_threshold(row, vocab, false, float(top_k), scratch);
        // elements strictly above the k-th value, then equal ones in index order up to k
        float above = 0.f;
        for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) above += order_key(row[v]) > kth;
        above = block_sum(above, scratch);
        const float room = float(top_k) - above;
        cut_at_threshold(row, vocab, kth, false, -INFINITY,
                         [room](float before) { return before < room; }, scratch);
    }
    float best = -INFINITY;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) best = fmaxf(best, row[v]);
    best = block_max(best, scratch);
    float sum = 0.f;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
        const float e = row[v] == -INFINITY ? 0.f : expf(row[v] - best);
        row[v] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) row[v] /= sum;
    __syncthreads();
    if (top_p < 1.f) {
        // The last kept token has the largest value t with mass(p >= t) >= top_p; ties at t are
        // kept in index order while the mass before them stays below top_p.
        const uint32_t crossing = bisect_threshold(row, vocab, true, top_p, scratch);
        float above = 0.f;
        for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x)
            if (order_key(row[v]) > crossing) above += row[v];
        above = block_sum(above, scratch);
        cut_at_threshold(row, vocab, crossing, true, 0.f,
                         [above, top_p](float before) { return above + before < top_p; }, scratch);
        float kept = 0.f;
        for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) kept += row[v];
        kept = block_sum(kept, scratch);
        for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) row[v] /= kept;
    }
}

__global__ void __launch_bounds__(kThreads)
sample_rows_kernel(const float *probs, int64_t vocab, RngKey key, uint32_t first_row,
                   uint32_t purpose, int32_t *out) {
    pdl_prologue();
    __shared__ float scratch[32];
    __shared__ int32_t pick;
    const float *row = probs + int64_t(blockIdx.x) * vocab;
    const float u = rng_uniform(key, first_row + blockIdx.x, purpose);
    const int32_t token = block_draw(vocab, u, [row](int64_t v) { return row[v]; }, scratch, &pick);
    if (threadIdx.x == 0) out[blockIdx.x] = token;
}

__global__ void greedy_accept_kernel(const int32_t *tokens, const int32_t *posterior, int64_t n,
                                     int32_t *out) {
    pdl_prologue();
    int32_t accepted = 0;
    while (accepted + 1 < n && tokens[accepted + 1] == posterior[accepted]) ++accepted;
    out[0] = accepted;
    out[1] = posterior[accepted];
}

__global__ void __launch_bounds__(kThreads)
rejection_accept_kernel(const float *p, const int32_t *tokens, const float *q, int64_t n,
                        int64_t vocab, RngKey key, int32_t *out) {
    pdl_prologue();
    __shared__ float scratch[32];
    __shared__ int32_t pick, accepted_s;
    if (threadIdx.x == 0) {
        int32_t accepted = 0;
        while (accepted + 1 < n) {
            const int32_t draft = tokens[accepted + 1];
            const float p_draft = p[accepted * vocab + draft];
            const float q_draft = q ? q[accepted * vocab + draft] : 1.f;
            if (!(rng_uniform(key, uint32_t(accepted + 1), RNG_ACCEPT) * q_draft < p_draft)) break;
            ++accepted;
        }
        accepted_s = accepted;
    }
    __syncthreads();
    const int32_t accepted = accepted_s;
    const float *row = p + int64_t(accepted) * vocab;
    const float u = rng_uniform(key, uint32_t(accepted), RNG_SAMPLE);
    int32_t next;
    if (accepted + 1 == n) {
        next = block_draw(vocab, u, [row](int64_t v) { return row[v]; }, scratch, &pick);
    } else {
        const int32_t draft = tokens[accepted + 1];
        const float *q_row = q ? q + int64_t(accepted) * vocab : nullptr;
        auto residual = [row, q_row, draft](int64_t v) {
            const float qv = q_row ? q_row[v] : (v == draft ? 1.f : 0.f);
            return fmaxf(row[v] - qv, 0.f);
        };
        float mass = 0.f;
        for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) mass += residual(v);
        mass = block_sum(mass, scratch);
        if (mass > 0.f)
            next = block_draw(vocab, u, residual, scratch, &pick);
        else
            next = block_draw(vocab, u, [row](int64_t v) { return row[v]; }, scratch, &pick);
    }
    if (threadIdx.x == 0) {
        out[0] = accepted;
        out[1] = next;
    }
}

}  // namespace

void sampling_probs(float *rows, int64_t m, int64_t vocab, float temperature, float top_p,
                    int32_t top_k, cudaStream_t s) {
    if (m == 0) return;
    launch(sampling_probs_kernel, unsigned(m), kThreads, 0, s, rows, vocab, temperature, top_p, top_k);
}

void sample_rows(const float *probs, int64_t m, int64_t vocab, RngKey key, uint32_t first_row,
                 uint32_t purpose, int32_t *out, cudaStream_t s) {
    if (m == 0) return;
    launch(sample_rows_kernel, unsigned(m), kThreads, 0, s, probs, vocab, key, first_row, purpose, out);
}

void greedy_accept(const int32_t *tokens, const int32_t *posterior, int64_t n, int32_t *out,
                   cudaStream_t s) {
    launch(greedy_accept_kernel, 1, 1, 0, s, tokens, posterior, n, out);
}

void rejection_accept(const float *p, const int32_t *tokens, const float *q, int64_t n,
                      int64_t vocab, RngKey key, int32_t *out, cudaStream_t s) {
    launch(rejection_accept_kernel, 1, kThreads, 0, s, p, tokens, q, n, vocab, key, out);
}

}  // namespace cuda
}  // namespace dflash
