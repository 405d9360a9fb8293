// weights.cpp: see weights.hpp.
#include "weights.hpp"

#include <cstring>

namespace dflash {

WeightView WeightStore::Tensor::view() const {
    WeightView v;
    v.data = buffer.get();
    v.dtype = dtype;
    v.tiled = tiled;
    if (shape.size() == 1) {  // a norm vector: one row of shape[0] values
        v.rows = 1;
        v.cols = shape[0];
    } else {
        v.rows = shape[0];
        v.cols = shape[1];
    }
    return v;
}

void WeightStore::set(const std::string &raw_name, dflash_dtype dtype, int32_t ndim,
                      const int64_t *shape, const void *data, const char *hint) {
    static const char kPrefix[] = "model.";
    std::string name = raw_name;
    if (name.rfind(kPrefix, 0) == 0) name = name.substr(sizeof(kPrefix) - 1);
    auto it = expected_.find(name);
    if (it == expected_.end())
        fail(DFLASH_STATUS_BAD_TENSOR, "unknown tensor '", raw_name, "' for this config", hint);
    if (tensors_.count(name)) fail(DFLASH_STATUS_BAD_TENSOR, "tensor '", raw_name, "' given twice");
    if (!dtype_valid(dtype))
        fail(DFLASH_STATUS_INVALID_ARGUMENT, "tensor '", raw_name, "' has unknown dtype ", int(dtype));
    if (!shape) fail(DFLASH_STATUS_INVALID_ARGUMENT, "tensor '", raw_name, "' shape is NULL");
    if (ndim < 1 || ndim > 8)
        fail(DFLASH_STATUS_BAD_TENSOR, "tensor '", raw_name, "' has ndim ", ndim, " (expected ",
             it->second.size(), ")");
    std::vector<int64_t> got(shape, shape + ndim);
    if (got != it->second)
        fail(DFLASH_STATUS_BAD_TENSOR, "tensor '", raw_name, "' has shape ", shape_string(got),
             ", expected ", shape_string(it->second));
    if (!data) fail(DFLASH_STATUS_INVALID_ARGUMENT, "tensor '", raw_name, "' data is NULL");
    int64_t count = 1;
    for (int64_t d : got) count *= d;
    Tensor t;
    t.dtype = backend_->weight_dtype(dtype);
    t.shape = got;
    t.buffer = DeviceBuffer(backend_.get(), size_t(count) * dtype_size(t.dtype));
    if (t.dtype == dtype) {
        backend_->upload(t.buffer.get(), data, t.buffer.bytes());
    } else {  // convert on the host, once, at load time
        if (t.dtype != DFLASH_DTYPE_BF16)
            fail(DFLASH_STATUS_INTERNAL, "weights can only be converted to BF16");
        std::vector<uint16_t> converted(static_cast<size_t>(count));
        for (int64_t i = 0; i < count; ++i) converted[size_t(i)] = float_to_bf16(load_as_float(data, dtype, i));
        backend_->upload(t.buffer.get(), converted.data(), t.buffer.bytes());
    }
    tensors_.emplace(name, std::move(t));
}

void WeightStore::require_complete() const {
    std::string missing;
    int n_missing = 0;
    for (const auto &e : expected_)
        if (!tensors_.count(e.first)) {
            if (n_missing < 8) missing += (n_missing ? ", " : "") + e.first;
            ++n_missing;
        }
    if (n_missing)
        fail(DFLASH_STATUS_BAD_TENSOR, "missing ", n_missing, " of ", expected_.size(),
             " tensors: ", missing, n_missing > 8 ? ", ..." : "");
}

WeightView WeightStore::view(const std::string &name) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) fail(DFLASH_STATUS_INTERNAL, "weight '", name, "' is not loaded");
    return it->second.view();
}

WeightStore::Tensor WeightStore::fuse_rows(const std::vector<std::string> &names) const {
    const Tensor &first = tensors_.at(names[0]);
    int64_t rows = 0;
    for (const auto &n : names) {
        const Tensor &t = tensors_.at(n);
        if (t.dtype != first.dtype)
            fail(DFLASH_STATUS_BAD_TENSOR, "tensors '", names[0], "' (", dtype_name(first.dtype),
                 ") and '", n, "' (", dtype_name(t.dtype), ") are fused and must share a dtype");
        rows += t.shape[0];
    }
    Tensor fused;
    fused.dtype = first.dtype;
    fused.shape = {rows, first.shape[1]};
    fused.buffer = DeviceBuffer(backend_.get(), size_t(rows * first.shape[1]) * dtype_size(first.dtype));
    size_t offset = 0;
    for (const auto &n : names) {
        const Tensor &t = tensors_.at(n);
        backend_->copy(static_cast<char *>(fused.buffer.get()) + offset, t.buffer.get(),
                       t.buffer.bytes());
        offset += t.buffer.bytes();
    }
    return fused;
}

// A tiled copy of a row-major matrix (the source is untouched, so a failure loses nothing).
WeightStore::Tensor WeightStore::tiled_copy(const Tensor &t) const {
    if (t.shape.size() != 2)
        fail(DFLASH_STATUS_INTERNAL, "only a matrix can be tiled for GEMM (got ", shape_string(t.shape), ")");
    Tensor out;
    out.dtype = t.dtype;
    out.shape = t.shape;
    out.tiled = true;
    out.buffer = DeviceBuffer(backend_.get(),
                              size_t(tiled_elements(t.shape[0], t.shape[1])) * dtype_size(t.dtype));
    backend_->tile_gemm_weight(t.view(), out.buffer.get());
    return out;
}

WeightStore::Tensor WeightStore::tiled_for_gemm(Tensor t) const {
    if (t.tiled || !backend_->tiles_gemm_weights()) return t;
    return tiled_copy(t);  // t (row-major) is freed on return
}

void WeightStore::tile_for_gemm(const std::string &name) {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) fail(DFLASH_STATUS_INTERNAL, "weight '", name, "' is not loaded");
    if (it->second.tiled || !backend_->tiles_gemm_weights()) return;
    it->second = tiled_copy(it->second);
}

}  // namespace dflash
