// common.hpp: the engine's error type, message formatting and dtype helpers.
//
// Inside the library every failure is an `Error` exception carrying a dflash_status and a
// message; api.cpp is the only place that catches it and turns it into a status code plus the
// thread-local last-error string. Nothing else crosses the C ABI.
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dflash.h"

// A small function both compilers build, for the host and (nvcc) the device: formulas the host side and
// the kernels must agree on live once.
#if defined(__CUDACC__)
#define DFLASH_HOST_DEVICE __host__ __device__
#else
#define DFLASH_HOST_DEVICE
#endif

namespace dflash {

class Error : public std::runtime_error {
public:
    Error(dflash_status status, const std::string &message)
        : std::runtime_error(message), status_(status) {}
    dflash_status status() const { return status_; }

private:
    dflash_status status_;
};

// cat("token ", 7, " >= vocab ", 5) -> "token 7 >= vocab 5"
template <typename... Args>
std::string cat(Args &&...args) {
    std::ostringstream out;
    (out << ... << std::forward<Args>(args));
    return out.str();
}

template <typename... Args>
[[noreturn]] void fail(dflash_status status, Args &&...args) {
    throw Error(status, cat(std::forward<Args>(args)...));
}

inline std::string shape_string(const std::vector<int64_t> &shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

inline size_t dtype_size(dflash_dtype dtype) { return dtype == DFLASH_DTYPE_F32 ? 4 : 2; }

inline const char *dtype_name(dflash_dtype dtype) {
    switch (dtype) {
        case DFLASH_DTYPE_F32: return "F32";
        case DFLASH_DTYPE_F16: return "F16";
        case DFLASH_DTYPE_BF16: return "BF16";
    }
    return "?";
}

inline bool dtype_valid(int dtype) {
    return dtype == DFLASH_DTYPE_F32 || dtype == DFLASH_DTYPE_F16 || dtype == DFLASH_DTYPE_BF16;
}

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t(bits >> 16);
}

inline float f16_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: renormalise
            int e = -1;
            do { ++e; mant <<= 1; } while (!(mant & 0x400));
            bits = sign | uint32_t(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | mant << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | mant << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Reads element i of a buffer of `dtype` as float.
inline float load_as_float(const void *data, dflash_dtype dtype, int64_t i) {
    switch (dtype) {
        case DFLASH_DTYPE_F32: return static_cast<const float *>(data)[i];
        case DFLASH_DTYPE_F16: return f16_to_float(static_cast<const uint16_t *>(data)[i]);
        case DFLASH_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t *>(data)[i]);
    }
    return 0.f;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rejects a params field outside [lo, hi], naming the struct and the field.
// A sequence's token budget: 0 means max_seq_len; negative or over max_seq_len is an error naming
// `owner` ("drafter" / "target").
inline int32_t sequence_budget(int32_t budget_tokens, int32_t max_seq_len, const char *owner) {
    if (budget_tokens < 0)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "budget_tokens ", budget_tokens, " is negative");
    if (budget_tokens > max_seq_len)
        fail(DFLASH_STATUS_CAPACITY, "budget_tokens ", budget_tokens, " exceeds the ", owner,
             "'s max_seq_len ", max_seq_len);
    return budget_tokens ? budget_tokens : max_seq_len;
}

inline void check_range(const char *params, const char *field, int64_t value, int64_t lo, int64_t hi) {
    if (value < lo || value > hi)
        fail(DFLASH_STATUS_INVALID_ARGUMENT, params, ": ", field, " = ", value, " is outside [", lo,
             ", ", hi, "]");
}

}  // namespace dflash
