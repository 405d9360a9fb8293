// philox.hpp: the counter-based random numbers every backend draws from (Philox4x32-10).
//
// A uniform is a pure function of (seed, call counter, row, purpose), so host and cuda produce
// the same stream without shared state, graph replays stay deterministic, and a run is
// reproducible from its seed. Compiles as host code and, under nvcc, as device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DFLASH_HD __host__ __device__ __forceinline__
#else
#define DFLASH_HD inline
#endif

namespace dflash {

// What a uniform is used for; part of the counter so the streams never overlap.
enum RngPurpose : uint32_t {
    RNG_DRAFT = 0,    // drafter samples its proposals
    RNG_ACCEPT = 1,   // rejection-sampling coin of each draft
    RNG_SAMPLE = 2,   // the target's next token (bonus, residual, prefill, AR)
};

struct RngKey {
    uint64_t seed = 0;
    uint64_t counter = 0;  // per-sequence call counter
};

DFLASH_HD uint32_t philox_mulhi(uint32_t a, uint32_t b, uint32_t *lo) {
    const uint64_t p = uint64_t(a) * uint64_t(b);
    *lo = uint32_t(p);
    return uint32_t(p >> 32);
}

// First 32-bit output of Philox4x32-10 for this key and counter.
DFLASH_HD uint32_t philox4x32_10(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
    uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
    for (int round = 0; round < 10; ++round) {
        uint32_t lo0, lo1;
        const uint32_t hi0 = philox_mulhi(0xD2511F53u, c0, &lo0);
        const uint32_t hi1 = philox_mulhi(0xCD9E8D57u, c2, &lo1);
        const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

// Uniform in [0, 1) with 24 random bits (exactly representable as float).
DFLASH_HD float rng_uniform(RngKey key, uint32_t row, uint32_t purpose) {
    const uint32_t bits = philox4x32_10(key.seed, uint32_t(key.counter), uint32_t(key.counter >> 32),
                                        row, purpose);
    return float(bits >> 8) * (1.0f / 16777216.0f);
}

}  // namespace dflash
