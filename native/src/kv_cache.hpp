// kv_cache.hpp: bookkeeping of a paged KV pool (which blocks are free), independent of memory.
//
// The block memory itself ([num_blocks, block_size, kv_width] per layer, K and V) belongs to the
// drafter; this class only hands out block ids, so taking and returning blocks never touches
// the device. Blocks are taken all-or-nothing: a request that cannot be met takes none.
#pragma once

#include <cstdint>
#include <vector>

#include "backend.hpp"
#include "common.hpp"

namespace dflash {

class BlockPool {
public:
    explicit BlockPool(int32_t num_blocks = 0) { reset(num_blocks); }

    void reset(int32_t num_blocks) {
        free_.clear();
        in_use_.assign(size_t(num_blocks), 0);
        // Hand out low ids first (stack pops from the back).
        for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
    }

    int32_t total() const { return int32_t(in_use_.size()); }
    int32_t available() const { return int32_t(free_.size()); }

    // Appends `count` block ids to `out`, or throws POOL_EXHAUSTED having taken none.
    void take(int32_t count, std::vector<int32_t> &out) {
        if (count > available())
            fail(DFLASH_STATUS_POOL_EXHAUSTED, "KV pool exhausted: need ", count, " more blocks, ",
                 available(), " of ", total(), " free (free a sequence, or raise max_batch)");
        for (int32_t i = 0; i < count; ++i) {
            const int32_t b = free_.back();
            free_.pop_back();
            in_use_[size_t(b)] = 1;
            out.push_back(b);
        }
    }

    // Returns blocks; a block not taken (double return) is an internal error, caught early.
    void give_back(const std::vector<int32_t> &blocks) {
        for (int32_t b : blocks) {
            if (b < 0 || b >= total() || !in_use_[size_t(b)])
                fail(DFLASH_STATUS_INTERNAL, "KV block ", b, " returned but not in use");
            in_use_[size_t(b)] = 0;
            free_.push_back(b);
        }
    }

    dflash_pool_stats stats(int32_t blocks_per_sequence, int32_t live_sequences) const {
        dflash_pool_stats s{};
        s.struct_size = sizeof(s);
        s.total_blocks = total();
        s.free_blocks = available();
        s.block_size = DFLASH_KV_BLOCK_SIZE;
        s.blocks_per_sequence = blocks_per_sequence;
        s.live_sequences = live_sequences;
        return s;
    }

private:
    std::vector<int32_t> free_;
    std::vector<uint8_t> in_use_;
};

// One sequence's blocks: the host list and its copy in backend memory (what kernels read).
class BlockTable {
public:
    BlockTable() = default;  // host only: whoever reads it on the device copies blocks() there
    BlockTable(Backend *backend, int32_t capacity)
        : device_(backend, size_t(capacity) * sizeof(int32_t)) {}

    const std::vector<int32_t> &blocks() const { return blocks_; }
    int32_t size() const { return int32_t(blocks_.size()); }
    const int32_t *device() const { return device_.as<int32_t>(); }  // nullptr when host only

    // Holds at least `need` blocks afterwards; all-or-nothing (POOL_EXHAUSTED takes none).
    void grow(BlockPool &pool, Backend &backend, int32_t need) {
        const int32_t have = size();
        if (need <= have) return;
        pool.take(need - have, blocks_);
        if (device_.get())
            backend.upload(device_.as<int32_t>() + have, blocks_.data() + have,
                           size_t(need - have) * sizeof(int32_t));
    }
    // Returns every block past the first `keep`.
    void shrink(BlockPool &pool, size_t keep) {
        if (blocks_.size() <= keep) return;
        pool.give_back(std::vector<int32_t>(blocks_.begin() + long(keep), blocks_.end()));
        blocks_.resize(keep);
    }

private:
    std::vector<int32_t> blocks_;
    DeviceBuffer device_;  // [capacity] int32
};

}  // namespace dflash
