// cuda_backend.cu: the cuda backend's device, stream and memory management.
//
// Status: memory, copies and streams work; the compute ops are not written yet (they come one
// .cu per op family: gemv.cu, norm.cu, rope.cu, attention.cu, kv_cache.cu, sampling.cu).
// Until then every op reports DFLASH_STATUS_NOT_SUPPORTED, and a drafter refuses to be created
// on this backend (Backend::missing_ops), so a caller learns it at create time, not mid-step.
#include <cstdio>

#include "../backend.hpp"
#include "common.cuh"

namespace dflash {
namespace {

[[noreturn]] void op_missing(const char *op) {
    fail(DFLASH_STATUS_NOT_SUPPORTED, "cuda backend: op '", op,
         "' is not supported yet; use the host backend");
}

class CudaBackend final : public Backend {
public:
    CudaBackend(int device, uint64_t stream) : device_(device) {
        DFLASH_CUDA_CHECK(cudaSetDevice(device));
        if (stream) {
            stream_ = reinterpret_cast<cudaStream_t>(stream);
        } else {
            DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
            owns_stream_ = true;
        }
    }
    ~CudaBackend() override {
        if (owns_stream_) {
            cudaSetDevice(device_);
            cudaStreamDestroy(stream_);
        }
    }

    dflash_backend kind() const override { return DFLASH_BACKEND_CUDA; }
    dflash_dtype act_dtype() const override { return DFLASH_DTYPE_BF16; }
    const char *missing_ops() const override { return "every compute op"; }

    void *alloc(size_t bytes) override {
        DFLASH_CUDA_CHECK(cudaSetDevice(device_));
        void *p = nullptr;
        cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
        if (err != cudaSuccess) {
            (void)cudaGetLastError();
            size_t free_b = 0, total_b = 0;
            cudaMemGetInfo(&free_b, &total_b);
            fail(cuda_status(err), "cudaMalloc of ", bytes, " bytes on device ", device_,
                 " failed: ", cudaGetErrorName(err), " (", free_b, " of ", total_b, " bytes free)");
        }
        return p;
    }
    void release(void *ptr) noexcept override {
        if (ptr) cudaFree(ptr);
    }
    void upload(void *dst, const void *src, size_t bytes) override {
        DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    }
    void download(void *dst, const void *src, size_t bytes) override {
        DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
        DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    void copy(void *dst, const void *src, size_t bytes) override {
        DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    void synchronize() override { DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

    void convert_rows(const void *, dflash_dtype, bool, int64_t, int64_t, void *) override {
        op_missing("convert_rows");
    }
    void embed(const int32_t *, int64_t, WeightView, float, void *) override { op_missing("embed"); }
    void rms_norm(const void *, int64_t, int64_t, int64_t, int64_t, WeightView, float, void *,
                  int64_t) override {
        op_missing("rms_norm");
    }
    void gemm(const void *, int64_t, int64_t, WeightView, void *, int64_t) override {
        op_missing("gemm");
    }
    void rope(void *, int64_t, int64_t, int64_t, int64_t, const int32_t *, const float *,
              float) override {
        op_missing("rope");
    }
    void kv_write(const void *, const void *, int64_t, int64_t, const int32_t *, int64_t, void *,
                  void *) override {
        op_missing("kv_write");
    }
    void attention(const void *, int64_t, const int32_t *, int64_t, int64_t, int64_t, float,
                   AttentionMask, const PagedKeys &, void *) override {
        op_missing("attention");
    }
    void add(void *, const void *, int64_t) override { op_missing("add"); }
    void swiglu(const void *, int64_t, int64_t, void *) override { op_missing("swiglu"); }
    void logits_argmax(const void *, int64_t, WeightView, float, float, int32_t *) override {
        op_missing("logits_argmax");
    }
    void copy_rows(const void *, int64_t, int64_t, int64_t, void *, int64_t) override {
        op_missing("copy_rows");
    }
    void logits(const void *, int64_t, WeightView, float, float, float *) override {
        op_missing("logits");
    }
    void sampling_probs(float *, int64_t, int64_t, float, float, int32_t) override {
        op_missing("sampling_probs");
    }
    void sample_rows(const float *, int64_t, int64_t, RngKey, uint32_t, uint32_t,
                     int32_t *) override {
        op_missing("sample_rows");
    }
    void greedy_accept(const int32_t *, const int32_t *, int64_t, int32_t *) override {
        op_missing("greedy_accept");
    }
    void rejection_accept(const float *, const int32_t *, const float *, int64_t, int64_t, RngKey,
                          int32_t *) override {
        op_missing("rejection_accept");
    }

private:
    int device_ = 0;
    cudaStream_t stream_ = nullptr;
    bool owns_stream_ = false;
};

}  // namespace

bool cuda_compiled() { return true; }

const char *cuda_arch_list() { return DFLASH_CUDA_ARCH_LIST; }

int cuda_device_count() {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        fail(DFLASH_STATUS_NO_DEVICE, "no CUDA device: cudaGetDeviceCount failed with ",
             cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
    }
    return count;
}

std::shared_ptr<Backend> make_cuda_backend(int device, uint64_t stream) {
    const int count = cuda_device_count();
    if (count == 0) fail(DFLASH_STATUS_NO_DEVICE, "no CUDA device: cudaGetDeviceCount returned 0");
    if (device < 0 || device >= count)
        fail(DFLASH_STATUS_OUT_OF_RANGE, "CUDA device ", device, " does not exist (", count,
             " visible)");
    return std::make_shared<CudaBackend>(device, stream);
}

}  // namespace dflash
