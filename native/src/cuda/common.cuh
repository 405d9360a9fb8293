// common.cuh: CUDA error checks for the cuda backend.
//
// DFLASH_CUDA_CHECK turns a failed CUDA call into an Error carrying the CUDA error name, the
// call and where it happened; api.cpp turns that into DFLASH_STATUS_CUDA_ERROR (or
// OUT_OF_MEMORY / NO_DEVICE). It never exits the process.
#pragma once

#include <cuda_runtime.h>

#include "../common.hpp"

namespace dflash {

inline dflash_status cuda_status(cudaError_t err) {
    switch (err) {
        case cudaErrorMemoryAllocation: return DFLASH_STATUS_OUT_OF_MEMORY;
        case cudaErrorNoDevice:
        case cudaErrorInsufficientDriver:
        case cudaErrorInvalidDevice: return DFLASH_STATUS_NO_DEVICE;
        default: return DFLASH_STATUS_CUDA_ERROR;
    }
}

[[noreturn]] inline void cuda_fail(cudaError_t err, const char *call, const char *file, int line) {
    fail(cuda_status(err), call, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
         ") at ", file, ":", line);
}

}  // namespace dflash

#define DFLASH_CUDA_CHECK(call)                                                     \
    do {                                                                            \
        cudaError_t dflash_err_ = (call);                                           \
        if (dflash_err_ != cudaSuccess) {                                           \
            (void)cudaGetLastError(); /* clear a sticky-free error for later calls */ \
            ::dflash::cuda_fail(dflash_err_, #call, __FILE__, __LINE__);            \
        }                                                                           \
    } while (0)
