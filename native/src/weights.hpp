// weights.hpp: named weight tensors in backend memory, validated against a model's config.
//
// A model (drafter or target) declares the tensors it expects with their shapes; set() checks
// each incoming tensor (known name, no duplicate, exact shape, valid dtype) and copies it to the
// backend once; require_complete() names what is missing. Stores are shared by pointer: a
// drafter created for a target reads the target's embed_tokens / lm_head from the target's store.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"

namespace dflash {

class WeightStore {
public:
    struct Tensor {
        DeviceBuffer buffer;
        dflash_dtype dtype = DFLASH_DTYPE_F32;
        std::vector<int64_t> shape;
        bool tiled = false;  // the backend's tiled GEMM layout (backend.hpp)
        WeightView view() const;
    };

    explicit WeightStore(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {}

    void expect(const std::string &name, std::vector<int64_t> shape) { expected_[name] = std::move(shape); }
    bool expects(const std::string &name) const { return expected_.count(name) != 0; }
    const std::vector<int64_t> &expected_shape(const std::string &name) const { return expected_.at(name); }

    // Validates and uploads one tensor. `hint` is appended to an unknown-name error.
    void set(const std::string &raw_name, dflash_dtype dtype, int32_t ndim, const int64_t *shape,
             const void *data, const char *hint = "");
    // Throws BAD_TENSOR naming the missing tensors (the first few, and how many).
    void require_complete() const;

    bool has(const std::string &name) const { return tensors_.count(name) != 0; }
    WeightView view(const std::string &name) const;
    // Concatenates 2-D tensors of one dtype along rows (K0;V0;K1;V1 or gate;up) into a new tensor.
    Tensor fuse_rows(const std::vector<std::string> &names) const;
    void erase(const std::string &name) { tensors_.erase(name); }

    // GEMM weights in the layout the backend streams fastest (Backend::tiles_gemm_weights): a
    // tiled copy replaces the row-major tensor (in place, by name; idempotent), or is returned.
    // Where the backend keeps row-major weights these change nothing.
    void tile_for_gemm(const std::string &name);
    Tensor tiled_for_gemm(Tensor t) const;

private:
    Tensor tiled_copy(const Tensor &t) const;

    std::shared_ptr<Backend> backend_;
    std::map<std::string, std::vector<int64_t>> expected_;
    std::map<std::string, Tensor> tensors_;
};

}  // namespace dflash
