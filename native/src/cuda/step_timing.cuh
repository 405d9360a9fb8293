// step_timing.cuh: DFLASH_STEP_TIMING=1 (read once), a diagnostic of where a step's time goes between the host and
// the GPU (docs/speed-log.md: written for session 37's idle GPU at a step's start; session 38 found verify's host
// path under 10 us and the graph plus the eager tail the whole step, and that idle time did not reproduce).
//
// A step, as the cuda backend sees it, runs from the first upload after a download (its arguments) to the next
// download (its result). The timer records GPU events with timing at the step's first upload (entry), before the
// first and after the last graph launch of the step, and after the download's copy, and times the host calls
// between them. At the backend's end it prints the medians over the steps seen (to stderr):
//   host  entry -> launch        the host's time from the step's first upload to its graph launch call
//   host  launch                 the graph launch calls themselves
//   host  launch -> download     the host's time from the launch to the download's enqueue
//   gpu   entry -> pre-launch    GPU time between the marks: the upload copies, and any time the GPU waited for the
//                                host (an idle GPU stamps an event when the host records it)
//   gpu   pre-launch -> launched the graph's span: its start latency on the GPU and its kernels
//   gpu   launched -> copied     what runs after the graph and the download's copy (a target step launches its
//                                lm_head, argmax and acceptance kernels eagerly after its graph: about 0.4 ms at 8B)
//   host  result -> first op     the host's time from the last step's result (its download returned) to this
//                                step's first copy or upload: the caller's code (Python, the bench loop) and
//                                the library's own before it
//   host  first copy -> entry    where the step's first op was rows appended from device memory (a propose after
//                                append_context_device), the host's time from that copy to the first upload
//   gpu   first copy -> entry    the GPU's time over the same span: the copy, then waiting for the host
// Steps without a graph (eager launches) print only their entry -> copied span. Nothing is recorded when the
// switch is off.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <cuda_runtime.h>

#include "common.cuh"

namespace dflash::cuda {

class StepTimer {
public:
    static bool enabled() {
        static const bool on = env_opt_in("DFLASH_STEP_TIMING");
        return on;
    }

    ~StepTimer() {
        report();
        for (cudaEvent_t e : events_)
            if (e) cudaEventDestroy(e);
    }

    // The step's first upload marks its entry (later uploads of the step do nothing).
    void on_upload(cudaStream_t s) {
        if (!enabled() || open_ || !ready()) return;
        open_ = true;
        launched_ = false;
        host_entry_ = now();
        cudaEventRecord(events_[kEntry], s);
        first_op(host_entry_);
        if (copied_first_) add(8, us(host_copy_, host_entry_));
    }
    // Rows appended from device memory (append_context_device, convert_rows) before the step's first upload mark
    // its first op: copied_first_ then holds until the step's download.
    void on_copy(cudaStream_t s) {
        if (!enabled() || open_ || !ready() || copied_first_ || !done_seen_) return;
        copied_first_ = true;
        host_copy_ = now();
        first_op(host_copy_);
        cudaEventRecord(events_[kFirstCopy], s);
    }
    void before_launch(cudaStream_t s) {
        if (!open_) return;
        host_launch_ = now();
        if (!launched_) {
            host_first_launch_ = host_launch_;
            cudaEventRecord(events_[kPre], s);
        }
    }
    void after_launch(cudaStream_t s) {
        if (!open_) return;
        launch_us_ += us(host_launch_, now());
        launched_ = true;
        cudaEventRecord(events_[kPost], s);
        host_post_ = now();
    }
    // The download's copy is enqueued (record after it), then waited for: the step ends.
    void on_download_enqueued(cudaStream_t s) {
        if (!open_) return;
        host_download_ = now();
        cudaEventRecord(events_[kCopied], s);
    }
    void on_download_done() {
        if (!open_) return;
        open_ = false;
        host_done_ = now();
        done_seen_ = true;
        const bool copied_first = copied_first_;  // this step began with appended rows (kFirstCopy recorded)
        first_op_seen_ = copied_first_ = false;
        if (cudaEventSynchronize(events_[kCopied]) != cudaSuccess) {
            (void)cudaGetLastError();
            return;
        }
        if (launched_) {
            add(0, us(host_entry_, host_first_launch_));
            add(1, launch_us_);
            add(2, us(host_post_, host_download_));
            add(3, gpu_ms(kEntry, kPre) * 1e3);
            add(4, gpu_ms(kPre, kPost) * 1e3);
            add(5, gpu_ms(kPost, kCopied) * 1e3);
        } else {
            add(6, gpu_ms(kEntry, kCopied) * 1e3);
        }
        if (copied_first) add(9, gpu_ms(kFirstCopy, kEntry) * 1e3);
        launch_us_ = 0;
    }

private:
    enum { kEntry, kPre, kPost, kCopied, kFirstCopy, kEvents };
    static constexpr int kSpans = 10;  // the report's rows (report()'s names)
    using Clock = std::chrono::steady_clock;
    static Clock::time_point now() { return Clock::now(); }
    static double us(Clock::time_point a, Clock::time_point b) {
        return std::chrono::duration<double, std::micro>(b - a).count();
    }
    bool ready() {
        if (failed_) return false;
        if (events_[0]) return true;
        for (cudaEvent_t &e : events_)
            if (cudaEventCreate(&e) != cudaSuccess) {
                (void)cudaGetLastError();
                failed_ = true;
                return false;
            }
        return true;
    }
    double gpu_ms(int a, int b) {
        float ms = 0.f;
        if (cudaEventElapsedTime(&ms, events_[a], events_[b]) != cudaSuccess) {
            (void)cudaGetLastError();
            return -1.0;
        }
        return double(ms);
    }
    void add(int what, double v) { samples_[what].push_back(v); }
    // The step's first op (copy or upload) closes the host's span since the last step's result.
    void first_op(Clock::time_point t) {
        if (first_op_seen_ || !done_seen_) return;
        first_op_seen_ = true;
        add(7, us(host_done_, t));
    }
    void report() {
        static const char *names[kSpans] = {"host  entry -> launch", "host  launch", "host  launch -> download",
                                       "gpu   entry -> pre-launch", "gpu   pre-launch -> launched",
                                       "gpu   launched -> copied", "gpu   entry -> copied (eager steps)",
                                       "host  result -> first op", "host  first copy -> entry",
                                       "gpu   first copy -> entry"};
        for (int i = 0; i < kSpans; ++i) {
            std::vector<double> &v = samples_[i];
            if (v.empty()) continue;
            std::sort(v.begin(), v.end());
            std::fprintf(stderr, "dflash step timing: %-34s %6zu steps, median %9.2f us, p10 %9.2f, p90 %9.2f\n",
                         names[i], v.size(), v[v.size() / 2], v[v.size() / 10], v[v.size() * 9 / 10]);
        }
    }

    cudaEvent_t events_[kEvents] = {};
    bool failed_ = false, open_ = false, launched_ = false;
    bool done_seen_ = false, first_op_seen_ = false, copied_first_ = false;
    Clock::time_point host_entry_, host_first_launch_, host_launch_, host_post_, host_download_, host_done_, host_copy_;
    double launch_us_ = 0;
    std::vector<double> samples_[kSpans];
};

}  // namespace dflash::cuda
