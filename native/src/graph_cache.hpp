// graph_cache.hpp: CUDA graphs of an engine step, one per shape key (DESIGN §5).
//
// run(backend, key, ops) -> replayed: the first call with a key runs `ops` eagerly (which sizes every scratch
// buffer they use: nothing may allocate while a capture records); the second records them as a
// graph and replays it; later calls only replay. A graph is recorded again when the backend's
// scratch has moved since its capture (scratch_epoch), and a key whose capture failed stays eager.
// `ops` must read everything that changes between calls from device memory the caller filled
// before run() (tokens, positions, slots, key counts); the key holds every host-side value and
// pointer that changes what `ops` enqueue.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "backend.hpp"

namespace dflash {

template <class Key>
class GraphCache {
public:
    bool run(Backend &backend, const Key &key, const std::function<void()> &ops) {
        if (!backend.graphs_enabled()) {
            ops();
            return false;
        }
        Entry &e = entries_[key];
        if (e.graph && e.epoch != backend.scratch_epoch()) e.graph.reset();
        if (!e.graph) {
            if (e.failed || e.eager_runs++ == 0) {
                ops();
                return false;
            }
            e.epoch = backend.scratch_epoch();
            backend.begin_capture();
            try {
                ops();
            } catch (...) {
                (void)backend.end_capture();  // leaves the stream usable; nothing was enqueued
                throw;
            }
            e.graph = backend.end_capture();
            if (!e.graph) {
                e.failed = true;
                ops();
                return false;
            }
        }
        backend.replay(*e.graph);
        return true;
    }

    // Drops the graphs whose keys match (a freed sequence's): their memory, not their correctness, is
    // the point (a graph reads only through the pointers in its key).
    template <class Pred>
    void erase_if(Pred pred) {
        for (auto it = entries_.begin(); it != entries_.end();) it = pred(it->first) ? entries_.erase(it) : ++it;
    }

private:
    struct Entry {
        std::unique_ptr<Graph> graph;
        uint64_t epoch = 0;
        int eager_runs = 0;
        bool failed = false;
    };
    std::map<Key, Entry> entries_;
};

}  // namespace dflash
