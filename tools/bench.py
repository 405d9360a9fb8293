#!/usr/bin/env python3
"""bench.py: pydflash step latency against the memory-bandwidth floor (and the reference), on a GPU.

Rows (issue 5), batch 1, bf16, random weights at real checkpoint shapes (not zeros):
  propose  Qwen3-8B-DFlash-b16 drafter: 7 new context rows + a 16-row block, context 1024 / 8192
  propose  Qwen3-4B-DFlash-b16 shapes (H 2560, I 9728), context 1024
  verify   Qwen3-8B target, 16 rows at context 1024
  decode   Qwen3-8B target, 1 row at context 1024
  prefill  the 8B target's prefill of a 1024-token prompt (the library's prefill_chunk, 512 rows): time to first
           token's share of the target
  *_8k     verify and decode at context 8192 (the floor adds the K/V cache bytes read; goal 1.15x the floor)
  *_cap32k verify, decode and the 8B propose again at context 1024, in sequences of capacity 32768 (a deployment's
           max_seq_len): what a large capacity costs
For each: the floor = bytes of weights a step must read / copy bandwidth measured in the same run (a
device-to-device copy; prefill: the larger of that and its FLOPs at the dense bf16 peak), our median time (CUDA events on our stream, >= 100 steps after warm-up), the ratio,
and, when torch + transformers + dflash import, the reference's median time measured the same way.

    python3 tools/bench.py [--rows propose8b,propose8b_8k,propose4b,verify,decode,verify_cap32k,...] [--iters 100]
                           [--no-reference] [--json OUT.json] [--plot OUT.png]
    python3 tools/bench.py --variants "default;DFLASH_GEMM_STREAM=0" [--rounds 2] [--rows ...]

Prints a table; --json writes every number; --plot a bar chart (matplotlib if installed).
--variants: A/B runs of the same rows under environment settings the library reads once per process
(";" between variants, "," between settings (a comma not followed by NAME= stays in the value), "default" for
none): each variant runs in its own
process, the order reversed every other round (so a GPU that warms up over the run shows as a
spread, not as a difference), and a table gives each row's median per variant and its ratio to the
first variant.

BENCH_CTX_SHORT=N (environment; a variant may set it): the short context (default 1024) of the propose, verify and
decode rows, e.g. 1000 against 1024 shows what the 17th key chunk of a 1040-key verify costs (16 splits of 64 keys).
"""
import os
import re
import subprocess
import argparse
import json
import sys
import time

import numpy as np

import pydflash
from pydflash.checkpoint import Tensor

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                max_position_embeddings=40960, tie_word_embeddings=False)
QWEN3_4B = dict(QWEN3_8B, hidden_size=2560, intermediate_size=9728)
CTX = {"short": int(os.environ.get("BENCH_CTX_SHORT", "1024")), "long": 8192, "ring": 32768}  # ring: a deployment's max_seq_len; --tiny shrinks these and the shapes above (a host-backend smoke run)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512)


def target_config(base, layers):
    return dict(base, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=layers)


def drafter_config(base):
    return dict(base, architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=5,
                num_target_layers=36, block_size=16,
                dflash_config={"mask_token_id": base["vocab_size"] - 1, "target_layer_ids": [1, 9, 17, 25, 33]})


class RandomPool:
    """Random bf16 bits (normal * 0.02, never zeros) large enough for any tensor; each tensor is a view at its
    own offset, so no two layers hold the same weights."""

    def __init__(self, elements, seed=0):
        rng = np.random.default_rng(seed)
        base = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).view(np.uint32)
        base = ((base + 0x7FFF + ((base >> 16) & 1)) >> 16).astype(np.uint16)
        self.bits = np.resize(base, elements + (1 << 24))
        self.next = 0

    def tensor(self, name, shape):
        n = int(np.prod(shape))
        offset = (self.next * 7919) % (1 << 24)  # a different start per tensor
        self.next += 1
        return Tensor(name, "BF16", tuple(shape), self.bits[offset:offset + n], "<random>")


def weight_bytes(shapes):
    return sum(int(np.prod(s)) * 2 for name, s in shapes.items()
               if "embed_tokens" not in name)  # a step reads a few embedding rows, not the table


# --------------------------------------------------------------------------------------------
# timing on a stream of ours, with CUDA events (cuda-python)


class Stream:
    def __init__(self):
        from cuda.bindings import runtime as rt

        self.rt = rt
        self.backend = "cuda"
        err, self.handle = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
        assert err == rt.cudaError_t.cudaSuccess, err

    profile_one_step = False  # --ncu-step: the CUDA profiler range covers one step after the warm-up

    def time_ms(self, fn, iters, warmup=10):
        rt = self.rt
        for _ in range(warmup):
            fn()
        if self.profile_one_step:
            rt.cudaDeviceSynchronize()
            rt.cudaProfilerStart()
            fn()
            rt.cudaDeviceSynchronize()
            rt.cudaProfilerStop()
        times = []
        _, start = rt.cudaEventCreate()
        _, stop = rt.cudaEventCreate()
        for _ in range(iters):
            rt.cudaEventRecord(start, self.handle)
            fn()
            rt.cudaEventRecord(stop, self.handle)
            rt.cudaEventSynchronize(stop)
            err, ms = rt.cudaEventElapsedTime(start, stop)
            times.append(ms)
        rt.cudaEventDestroy(start)
        rt.cudaEventDestroy(stop)
        return float(np.median(times))

    def copy_bandwidth(self, nbytes=4 << 30):
        """Device-to-device copy bandwidth in bytes/s (read + write counted, as nvbandwidth does)."""
        rt = self.rt
        _, a = rt.cudaMalloc(nbytes)
        _, b = rt.cudaMalloc(nbytes)
        copy = lambda: rt.cudaMemcpyAsync(b, a, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.handle)
        ms = self.time_ms(copy, 20, warmup=3)
        rt.cudaFree(a)
        rt.cudaFree(b)
        return 2 * nbytes / (ms / 1e3)


PROFILE = {"on": False, "tables": {}, "timeline": False, "timelines": {}}  # --profile / --timeline: a few steps of each row


def profile_steps(key, step, steps=5):
    """Per-kernel GPU time over `steps` steps (torch.profiler's CUPTI sees every kernel in the process, ours
    included), as rows {kernel, calls, total_us, per_step_us}, sorted by time."""
    if PROFILE["timeline"]:
        timeline_steps(key, step)
    if not PROFILE["on"]:
        return
    rows = {}
    for e in cuda_activities(step, steps):
        r = rows.setdefault(e.name, [0, 0.0])
        r[0] += 1
        r[1] += e.device_time
    table = sorted(({"kernel": k[:90], "calls_per_step": c / steps, "per_step_us": t / steps}
                    for k, (c, t) in rows.items()), key=lambda r: -r["per_step_us"])
    PROFILE["tables"][key] = table
    total = sum(r["per_step_us"] for r in table)
    print(f"  kernels of one {key} step: {total:.1f} us of GPU time in "
          f"{sum(r['calls_per_step'] for r in table):.0f} launches", flush=True)
    for r in table[:12]:
        print(f"    {r['per_step_us']:9.1f} us  {r['calls_per_step']:5.1f}x  {r['kernel']}", flush=True)


def cuda_activities(step, steps, pause_s=0.0):
    """The GPU activities (kernels, copies) of `steps` steps after one warm-up step, as torch.profiler (CUPTI) records
    them. pause_s > 0: the GPU idles that long before each step, so the steps' activities can be told apart."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if pause_s:
                torch.cuda.synchronize()
                time.sleep(pause_s)
            step()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type.name == "CUDA"]


def timeline_steps(key, step, steps=20):
    """--timeline: how much of a timed step is the GPU waiting for the host. time_ms records its start event on an
    idle GPU, so the step's time includes the host's work before its first kernel runs (Python, the uploads, the
    eager launches, the graph launch). Here a 2 ms sleep kernel goes first (torch.cuda._sleep on our stream), the
    start event after it, so the host has queued the step's launches before the GPU reaches them: that time is
    the GPU's own (plus the host's tail after the download: the same in both). Prints both medians and the
    difference, the host's share at the step's start. (CUPTI tracing was tried first: it slows graph launches by
    hundreds of us, so it cannot show this.)"""
    import torch
    from cuda.bindings import runtime as rt

    stream = PROFILE["stream"]
    torch_stream = torch.cuda.ExternalStream(int(stream))
    clock_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0)  # not in every torch
    cycles = int(2e-3 * clock_khz * 1e3) if clock_khz else 4_000_000
    _, e0 = rt.cudaEventCreate()
    _, e1 = rt.cudaEventCreate()
    plain, queued, host = [], [], []
    for i in range(2 * steps):
        rt.cudaStreamSynchronize(stream)
        if i % 2:
            with torch.cuda.stream(torch_stream):
                torch.cuda._sleep(cycles)
        rt.cudaEventRecord(e0, stream)
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e6)
        rt.cudaEventRecord(e1, stream)
        rt.cudaEventSynchronize(e1)
        (queued if i % 2 else plain).append(rt.cudaEventElapsedTime(e0, e1)[1] * 1e3)
    rt.cudaEventDestroy(e0)
    rt.cudaEventDestroy(e1)
    p, q, h = float(np.median(plain)), float(np.median(queued)), float(np.median(host[0::2]))
    PROFILE["timelines"][key] = {"plain_us": p, "prequeued_us": q, "host_share_us": p - q, "host_wall_us": h,
                                 "sleep_cycles": cycles}
    print(f"  {key}: {p:.1f} us timed as bench times it, {q:.1f} us with its launches queued behind a sleep: "
          f"{p - q:.1f} us ({(p - q) / p:.1%}) of GPU idle waiting for the host at the start "
          f"(the step's host wall time {h:.1f} us)", flush=True)
    critical_path(key, step)


def short_kernel(name):
    """A kernel's name without namespaces and arguments; templates kept (they tell the GEMM families apart)."""
    name = name.replace("dflash::cuda::", "").replace("(anonymous namespace)::", "")
    depth, out = 0, []
    for ch in name:  # cut at the argument list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            break
        out.append(ch)
    return "".join(out).replace("(dflash::cuda::", "(").replace("dflash::cuda::", "")[:70]


def critical_path(key, step, steps=6):
    """--timeline, second part: each kernel's share of a step's critical path, from CUPTI (torch.profiler) records
    of a few steps. Activities sorted by end (stream order; under PDL a kernel starts early but ends after its
    predecessor): kernel i's share is end_i - max(start_i, end_(i-1)), the time the step's end moved because of
    it; a gap is start_i - end_(i-1) where positive. Per position in the step (the same sequence every step):
    the median over the steps; then per position in a layer, the median over the middle layers (the period of the
    kernel names). CUPTI slows graph launches (the gap before a graph's first kernel is the tracer's), not the
    kernels inside them."""
    acts = sorted(((e.time_range.start, e.time_range.end, e.name)
                   for e in cuda_activities(step, steps, pause_s=0.003)),  # steps split at the pauses
                  key=lambda a: (a[1], a[0]))
    groups, cur = [], []
    for a in acts:
        if cur and a[0] - cur[-1][1] > 2000:
            groups.append(cur)
            cur = []
        cur.append(a)
    if cur:
        groups.append(cur)
    sizes = [len(g) for g in groups]
    modal = max(set(sizes), key=sizes.count)
    groups = [g for g in groups if len(g) == modal]  # (a step whose copies CUPTI split or merged differently)
    if len(groups) < 3:
        print(f"  critical path of {key}: {len(sizes)} groups of sizes {sorted(set(sizes))} for {steps} steps: "
              f"not split", flush=True)
        return
    steps = len(groups)
    n = len(groups[0])
    names = [short_kernel(a[2]) for a in groups[0]]
    share = np.zeros((steps, n))
    gap = np.zeros((steps, n))
    overlapped = 0
    for si, g in enumerate(groups):
        for i, (s0, s1, _) in enumerate(g):
            prev = g[i - 1][1] if i else s0
            share[si, i] = s1 - max(s0, prev)
            gap[si, i] = max(0.0, s0 - prev)
            overlapped += i > 0 and s0 < prev
    med, med_gap = np.median(share, axis=0), np.median(gap, axis=0)
    # the layer period: the smallest p whose names repeat over the longest run
    best = (0, 0, 0)  # (run, period, first position of the run)
    for p in range(3, 16):
        run = 0
        for i in range(n - p):
            run = run + 1 if names[i] == names[i + p] else 0
            if run > best[0]:
                best = (run, p, i - run + 1)
    run, period, first = best
    out = {"kernels_per_step": n, "overlapped_fraction": overlapped / max(1, steps * (n - 1)),
           "step_span_us": float(np.median([g[-1][1] - g[0][0] for g in groups])),
           "gaps_us": float(med_gap.sum()), "positions": [{"kernel": names[i], "us": round(float(med[i]), 2),
                                                          "gap_us": round(float(med_gap[i]), 2)} for i in range(n)]}
    print(f"  critical path of one {key} step: {n} activities, span {out['step_span_us']:.1f} us, gaps "
          f"{out['gaps_us']:.1f} us, {out['overlapped_fraction']:.0%} start before their predecessor ends", flush=True)
    layer_pos = set()
    if period and run >= 2 * period:
        layers = (run + period) // period
        lo, hi = first + period, first + (layers - 1) * period  # the middle layers
        rows = []
        for j in range(period):
            idx = list(range(lo + j, min(hi, n), period))
            layer_pos.update(range(first + j, min(first + layers * period, n), period))
            rows.append((names[lo + j], float(np.median(med[idx])), float(np.median(med_gap[idx]))))
        out["layer"] = [{"kernel": k, "us": round(u, 2), "gap_us": round(gp, 2)} for k, u, gp in rows]
        print(f"    per layer ({layers} layers of {period}; medians of the middle ones): "
              f"{sum(r[1] for r in rows):.1f} us", flush=True)
        for k, u, gp in rows:
            print(f"      {u:7.2f} us (gap {gp:5.2f})  {k}", flush=True)
    rest = [(i, names[i], float(med[i]), float(med_gap[i])) for i in range(n) if i not in layer_pos]
    print(f"    outside the layers: {sum(r[2] for r in rest):.1f} us", flush=True)
    for i, k, u, gp in rest:
        print(f"      #{i:3d} {u:7.2f} us (gap {gp:6.2f})  {k}", flush=True)
    PROFILE["timelines"][key + " critical path"] = out


class HostClock:
    """--tiny: the host backend, wall-clock timing; checks the script end to end on a machine with no GPU."""

    handle = None
    backend = "host"

    def time_ms(self, fn, iters, warmup=2):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times))

    def copy_bandwidth(self, nbytes=1 << 26):
        a = np.ones(nbytes // 4, np.float32)
        b = np.empty_like(a)
        t0 = time.perf_counter()
        np.copyto(b, a)
        return 2 * nbytes / (time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# pydflash rows


def build_target(stream, pool, base, layers, **sizing):
    cfg = target_config(base, layers)
    shapes = pydflash.TargetConfig.from_json(cfg).tensor_shapes()
    tensors = {name: pool.tensor(name, shape) for name, shape in shapes.items()}
    target = pydflash.Target.from_tensors(cfg, tensors, backend=stream.backend, stream=stream.handle,
                                          **sizing)
    return target, weight_bytes(shapes)


def build_drafter(stream, pool, base, **sizing):
    """A standalone drafter (its own copy of embed_tokens / lm_head): no 36-layer target needed to time it."""
    cfg, target_cfg = drafter_config(base), target_config(base, 36)
    shapes = pydflash.DrafterConfig.from_json(cfg).tensor_shapes(pydflash.TargetInfo.from_json(target_cfg))
    tensors = {name: pool.tensor(name, shape) for name, shape in shapes.items()}
    drafter = pydflash.Drafter.from_tensors(cfg, tensors, target_config=target_cfg, backend=stream.backend,
                                            stream=stream.handle, **sizing)
    return drafter, weight_bytes(shapes)  # lm_head included: a propose reads it whole


class DeviceRows:
    """bf16 feature rows in device memory (the target's capture would leave them there)."""

    def __init__(self, pool, rows, width, on_device=True):
        host = np.ascontiguousarray(pool.bits[:rows * width])
        self.host, self.width, self.on_device = host.reshape(rows, width), width, on_device
        if not on_device:
            return
        from cuda.bindings import runtime as rt

        self.rt = rt
        err, self.ptr = rt.cudaMalloc(host.nbytes)
        assert err == rt.cudaError_t.cudaSuccess, err
        rt.cudaMemcpy(self.ptr, host.ctypes.data, host.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice)
        self.row_bytes = width * 2

    def append(self, seq, first, n):
        if self.on_device:
            seq.append_context_device(int(self.ptr) + first * self.row_bytes, n, "bf16")
        else:
            seq.append_context(self.host[first:first + n], dtype="bf16")

    def free(self):
        if self.on_device:
            self.rt.cudaFree(self.ptr)


def bench_propose(stream, pool, base, ctx, iters, max_seq_len=None):
    """Steady state of a decode loop: 7 committed rows arrive (device to device), then a 16-row block is proposed.
    The context grows by 7 rows a step (ctx + 7 * (iters + warm-up) at the end). max_seq_len: the sequence's
    capacity (default: just what the run needs)."""
    steps = 2 * (iters + 20) + 30  # every timing (and profile) run appends rows
    budget = max(ctx + 16 + 8 * steps, max_seq_len or 0)
    drafter, floor_bytes = build_drafter(stream, pool, base, max_seq_len=budget)
    rows = DeviceRows(pool, ctx + 7, drafter.feature_width, on_device=stream.backend == "cuda")
    seq = drafter.new_sequence(budget)
    rows.append(seq, 0, ctx)
    state = {"pos": ctx}
    seq.propose(5, ctx, 15)
    seq.after_verify(6)

    def step():
        rows.append(seq, ctx, 7)
        state["pos"] += 7
        seq.propose(5, state["pos"], 15)
        seq.after_verify(6)  # nothing staged (no target verify here): the 7 rows were appended above

    ms = stream.time_ms(step, iters)
    profile_steps(f"propose {base['hidden_size']} ctx {ctx}" + (f" of {budget}" if max_seq_len else ""), step)
    seq.close()
    drafter.close()
    rows.free()
    return ms, floor_bytes


def bench_target(stream, pool, rows, iters, max_seq_len=None, ctx=None):
    """One verify of `rows` rows at context `ctx` (default 1024), rolled back after each step. max_seq_len: the
    sequence's capacity (default ctx + 64; a deployment's max_seq_len is a row of its own). Past the short
    context the floor counts the K/V cache bytes the step reads as well as the weights."""
    long_ctx = ctx is not None
    ctx = ctx or CTX["short"]
    capacity = max_seq_len or ctx + 64
    target, floor_bytes = build_target(stream, pool, QWEN3_8B, 36, max_seq_len=capacity, prefill_chunk=256)
    seq = target.new_sequence(capacity)
    prompt = np.random.default_rng(2).integers(0, QWEN3_8B["vocab_size"], size=ctx).tolist()
    token = seq.prefill(prompt)
    block = [token] + [7] * (rows - 1)

    def step():
        accepted, _ = seq.verify(block)
        seq.rollback(accepted + 1)  # back to context ctx

    ms = stream.time_ms(step, iters)
    profile_steps(f"verify {rows} rows" + (f" ctx {ctx}" if long_ctx else "") +
                  (f" of {capacity}" if max_seq_len else ""), step)
    seq.close()
    target.close()
    if long_ctx:  # K and V of every layer, bf16
        floor_bytes += ctx * 36 * 2 * QWEN3_8B["num_key_value_heads"] * QWEN3_8B["head_dim"] * 2
    return ms, floor_bytes


# Dense bf16 tensor-core peak of an H200 SXM (NVIDIA's datasheet, not measured here): the compute floor of prefill.
PEAK_BF16_FLOPS = 989e12


def prefill_flops(base, layers, tokens):
    """Multiply-adds x 2 of a causal prefill of `tokens` rows: the layers' GEMMs, attention (q.k and p.v over the
    keys at or before each row), and lm_head for the last row only."""
    H, I, hd = base["hidden_size"], base["intermediate_size"], base["head_dim"]
    nh, nkv = base["num_attention_heads"], base["num_key_value_heads"]
    per_row = H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I
    attention = 2 * nh * hd * tokens * (tokens + 1) // 2
    return 2 * (layers * (per_row * tokens + attention) + base["vocab_size"] * H)


def bench_prefill(stream, pool, iters):
    """Time to first token's share of the target: a 1024-token prompt prefilled in the library's chunks (512 rows;
    BENCH_PREFILL_CHUNK=N sets them), rolled back after each run. Its floor is the larger of the weights read once and the FLOPs at the tensor cores' peak
    (PEAK_BF16_FLOPS): prefill is compute-bound (no goal)."""
    ctx = CTX["short"]
    chunk = os.environ.get("BENCH_PREFILL_CHUNK")  # an A/B knob of this script (--variants); unset: the library's
    target, floor_bytes = build_target(stream, pool, QWEN3_8B, 36, max_seq_len=ctx + 64,
                                       prefill_chunk=int(chunk) if chunk else None)
    seq = target.new_sequence(ctx + 64)
    prompt = np.random.default_rng(3).integers(0, QWEN3_8B["vocab_size"], size=ctx).tolist()

    def step():
        seq.prefill(prompt)
        seq.rollback(ctx)

    ms = stream.time_ms(step, max(3, min(iters, 10)), warmup=2)
    profile_steps("prefill", step, steps=1)
    seq.close()
    target.close()
    return ms, floor_bytes, prefill_flops(QWEN3_8B, 36, ctx) / PEAK_BF16_FLOPS * 1e3


# --------------------------------------------------------------------------------------------
# the reference (torch eager, transformers layers, dflash.model), same shapes


def reference_available():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import dflash.model  # noqa: F401
        return torch.cuda.is_available()
    except Exception:
        return False


def torch_time_ms(fn, iters, warmup=10):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def reference_propose(base, ctx, iters):
    import torch
    from transformers import Qwen3Config
    from dflash.model import DFlashDraftModel, _make_cache, _crop_to

    torch.manual_seed(0)
    cfg = Qwen3Config(**{k: v for k, v in drafter_config(base).items() if k not in ("architectures",)})
    with torch.device("cuda"):
        model = DFlashDraftModel(cfg).to(torch.bfloat16).eval()
        lm_head = torch.nn.Linear(base["hidden_size"], base["vocab_size"], bias=False).to(torch.bfloat16)
        embed = torch.randn(base["vocab_size"], base["hidden_size"], dtype=torch.bfloat16) * 0.02
    width = 5 * base["hidden_size"]
    cache = _make_cache(model.config)
    with torch.inference_mode():
        ctx_feats = torch.randn(1, ctx, width, device="cuda", dtype=torch.bfloat16)
        noise = embed[torch.full((1, 16), 7, device="cuda")]
        model(target_hidden=ctx_feats, noise_embedding=noise,
              position_ids=torch.arange(ctx + 16, device="cuda")[None], past_key_values=cache, use_cache=True)
        _crop_to(cache, ctx)
        new = torch.randn(1, 7, width, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(ctx, ctx + 7 + 16, device="cuda")[None]

        def step():  # exactly dflash_generate's drafter half (the cache is cropped back each time)
            h = model(target_hidden=new, noise_embedding=noise, position_ids=pos, past_key_values=cache,
                      use_cache=True)[:, -15:, :]
            _crop_to(cache, ctx)
            return torch.argmax(model.compute_logits(h, lm_head), dim=-1)

        ms = torch_time_ms(step, iters)
    del model, lm_head, embed, cache
    torch.cuda.empty_cache()
    return ms


def reference_target(rows, iters):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from dflash.model import _make_cache, _crop_to

    torch.manual_seed(0)
    cfg = Qwen3Config(**{k: v for k, v in target_config(QWEN3_8B, 36).items() if k != "architectures"})
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    cache = _make_cache(model.config)
    with torch.inference_mode():
        model(torch.randint(0, 151936, (1, 1024), device="cuda"), past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        block = torch.randint(0, 151936, (1, rows), device="cuda")
        pos = torch.arange(1024, 1024 + rows, device="cuda")[None]

        def step():
            out = model(block, position_ids=pos, past_key_values=cache, use_cache=True)
            _crop_to(cache, 1024)
            return torch.argmax(out.logits, dim=-1)

        ms = torch_time_ms(step, iters)
    del model, cache
    torch.cuda.empty_cache()
    return ms


# --------------------------------------------------------------------------------------------

ROWS = {
    "propose8b": ("propose 8B drafter, ctx 1024", 0.90, lambda s, p, it: bench_propose(s, p, QWEN3_8B, CTX["short"], it),
                  lambda it: reference_propose(QWEN3_8B, CTX["short"], it)),
    "propose8b_8k": ("propose 8B drafter, ctx 8192", 1.00, lambda s, p, it: bench_propose(s, p, QWEN3_8B, CTX["long"], it),
                     lambda it: reference_propose(QWEN3_8B, CTX["long"], it)),
    "propose4b": ("propose 4B drafter, ctx 1024", 0.52, lambda s, p, it: bench_propose(s, p, QWEN3_4B, CTX["short"], it),
                  lambda it: reference_propose(QWEN3_4B, CTX["short"], it)),
    "verify": ("verify 8B target, 16 rows, ctx 1024", 4.10, lambda s, p, it: bench_target(s, p, 16, it),
               lambda it: reference_target(16, it)),
    "decode": ("decode 8B target, 1 row, ctx 1024", 3.90, lambda s, p, it: bench_target(s, p, 1, it),
               lambda it: reference_target(1, it)),
    # Time to first token (not issue 5's rows): compute-bound, so no goal against the bandwidth floor.
    "prefill": ("prefill 8B target, 1024 tokens", "-", lambda s, p, it: bench_prefill(s, p, it), None),
    # Long contexts (not issue 5's rows): the floor adds the K/V cache a step reads; the goal is 1.15x that floor.
    "verify_8k": ("verify 8B target, 16 rows, ctx 8192", None,
                  lambda s, p, it: bench_target(s, p, 16, it, ctx=CTX["long"]), None),
    "decode_8k": ("decode 8B target, 1 row, ctx 8192", None,
                  lambda s, p, it: bench_target(s, p, 1, it, ctx=CTX["long"]), None),
    # The same steps in sequences of capacity 32768 (a deployment's max_seq_len), still at context 1024: the
    # goal is that capacity costs nothing. No reference row (its time does not depend on a capacity).
    "verify_cap32k": ("verify 8B target, 16 rows, ctx 1024 of 32768", 4.10,
                      lambda s, p, it: bench_target(s, p, 16, it, max_seq_len=CTX["ring"]), None),
    "decode_cap32k": ("decode 8B target, 1 row, ctx 1024 of 32768", 3.90,
                      lambda s, p, it: bench_target(s, p, 1, it, max_seq_len=CTX["ring"]), None),
    "propose8b_cap32k": ("propose 8B drafter, ctx 1024 of 32768", 0.90,
                         lambda s, p, it: bench_propose(s, p, QWEN3_8B, CTX["short"], it, max_seq_len=CTX["ring"]),
                         None),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of a few steps (needs torch)")
    ap.add_argument("--timeline", action="store_true",
                    help="where a step's GPU idles: the host's share and the gaps between activities (needs torch)")
    ap.add_argument("--ncu-step", action="store_true",
                    help="a CUDA profiler range around one step of each row, for ncu --profile-from-start off "
                         "(tools/ncu_step.sh)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the host backend: a smoke run, no GPU")
    ap.add_argument("--variants", help='A/B: "default;NAME=VALUE,NAME=VALUE;..." (see the top of this file)')
    ap.add_argument("--rounds", type=int, default=2, help="--variants: runs of each variant")
    args = ap.parse_args(argv)
    if args.variants:
        return run_variants(args)

    if args.tiny:
        QWEN3_8B.update(TINY)
        QWEN3_4B.update(TINY, hidden_size=48)
        CTX.update(short=64, long=160, ring=640)
    stream = HostClock() if args.tiny else Stream()
    stream.profile_one_step = args.ncu_step and not args.tiny
    PROFILE["on"] = args.profile and not args.tiny
    PROFILE["timeline"] = args.timeline and not args.tiny
    PROFILE["stream"] = getattr(stream, "handle", None)
    bandwidth = stream.copy_bandwidth()
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)
    pool = RandomPool(QWEN3_8B["vocab_size"] * QWEN3_8B["hidden_size"])  # the largest tensor: embed / lm_head
    with_reference = not args.no_reference and not args.tiny and reference_available()
    results = []
    for key in args.rows.split(","):
        title, goal_ms, ours, reference = ROWS[key]
        t0 = time.time()
        measured = ours(stream, pool, args.iters)  # (ms, bytes) or, compute-bound, (ms, bytes, compute floor ms)
        ms, floor_bytes = measured[:2]
        compute_floor_ms = measured[2] if len(measured) > 2 else None
        floor_ms = max(floor_bytes / bandwidth * 1e3, compute_floor_ms or 0.0)
        goal_ms = goal_ms if goal_ms is not None else 1.15 * floor_ms
        goal_txt = goal_ms if isinstance(goal_ms, str) else f"{goal_ms:.2f}"
        row = {"row": key, "title": title, "floor_ms": floor_ms, "bytes": floor_bytes, "ms": ms,
               "ratio": ms / floor_ms, "goal_ms": None if isinstance(goal_ms, str) else goal_ms}
        if compute_floor_ms is not None:
            row["compute_floor_ms"] = compute_floor_ms
            row["bandwidth_floor_ms"] = floor_bytes / bandwidth * 1e3
        if with_reference and reference:
            try:
                row["reference_ms"] = reference(max(20, args.iters // 5))
            except Exception as e:  # the reference is optional; say why it is missing
                row["reference_error"] = f"{type(e).__name__}: {e}"
        results.append(row)
        print(f"{title:46s} floor {floor_ms:6.3f} ms  ours {ms:7.3f} ms  x{ms / floor_ms:5.2f}  goal {goal_txt}"
              + (f"  reference {row['reference_ms']:7.2f} ms" if "reference_ms" in row else "")
              + f"  ({time.time() - t0:.0f} s)", flush=True)

    print()
    print(f"| step | floor (ms) | pydflash (ms) | / floor | goal (ms) | reference (ms) | vs reference |")
    print(f"|---|---|---|---|---|---|---|")
    for r in results:
        ref = r.get("reference_ms")
        ref_ms = "-" if ref is None else f"{ref:.2f}"
        speedup = "-" if ref is None else f"{ref / r['ms']:.1f}x faster"
        goal = "-" if r["goal_ms"] is None else f"{r['goal_ms']:.2f}"
        print(f"| {r['title']} | {r['floor_ms']:.3f} | {r['ms']:.3f} | {r['ratio']:.2f}x | {goal} | "
              f"{ref_ms} | {speedup} |")
    projection = project_speedup(results)
    report = {"bandwidth_bytes_per_s": bandwidth, "rows": results, "profile": PROFILE["tables"],
              "timeline": PROFILE["timelines"],
              "projection": projection}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("--plot needs matplotlib", file=sys.stderr)
        else:
            fig, ax = plt.subplots(figsize=(9, 4))
            x = np.arange(len(results))
            ax.bar(x - 0.2, [r["floor_ms"] for r in results], 0.4, label="floor (bandwidth; prefill: compute)")
            ax.bar(x + 0.2, [r["ms"] for r in results], 0.4, label="pydflash")
            ax.set_xticks(x, [r["row"] for r in results])
            ax.set_ylabel("ms per step")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
    return 0


# Published acceptance lengths (tokens per verify step, bonus included) of z-lab/Qwen3-8B-DFlash-b16 on an H200,
# greedy, and the speedups over autoregressive decoding the paper reports for them (DFlash paper, Table 1; see
# shared/reference/dflash-ecosystem.md section 1a).
PUBLISHED_TAU = [("MT-Bench", 4.24, 2.75), ("mean of 7 benchmarks", 6.49, 4.86), ("MATH-500", 7.87, 6.08)]


def project_speedup(results):
    """End-to-end tokens/s of the 8B pair from the measured step times, at the published acceptance lengths: a
    speculative step is one propose (ctx 1024) plus one 16-row verify and commits tau tokens; an autoregressive step
    is one decode and commits one. A projection from measured times, not a measured generation (random weights
    accept nothing); `pydflash bench` measures real generations on the trained default pair."""
    ms = {r["row"]: r["ms"] for r in results}
    if not {"propose8b", "verify", "decode"} <= ms.keys():
        return None
    step = ms["propose8b"] + ms["verify"]
    ar_tps = 1e3 / ms["decode"]
    rows = [{"workload": name, "tau": tau, "spec_tokens_per_s": tau * 1e3 / step, "ar_tokens_per_s": ar_tps,
             "speedup": tau * ms["decode"] / step, "paper_speedup": paper} for name, tau, paper in PUBLISHED_TAU]
    print()
    print(f"Projected end to end, Qwen3-8B + its b16 drafter (step = propose {ms['propose8b']:.3f} + verify "
          f"{ms['verify']:.3f} ms; autoregressive = decode {ms['decode']:.3f} ms):")
    print("| workload | published tau | speculative tok/s | autoregressive tok/s | speedup | paper's speedup |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['tau']:.2f} | {r['spec_tokens_per_s']:.0f} | {r['ar_tokens_per_s']:.0f} | "
              f"{r['speedup']:.2f}x | {r['paper_speedup']:.2f}x |")
    return {"step_ms": step, "decode_ms": ms["decode"], "rows": rows}


def parse_variant(text):
    text = text.strip()
    if text in ("", "default"):
        return "default", {}
    env = {}
    # A comma starts a new setting only where NAME= follows, so a value may hold commas (DFLASH_X=1,8).
    for item in re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*=)", text):
        name, sep, value = item.strip().partition("=")
        if not sep or not name:
            raise SystemExit(f"--variants: '{item}' is not NAME=VALUE")
        env[name] = os.path.expandvars(value)  # e.g. DFLASH_LIBRARY=$AB_LIBRARY (gpu_check.sh --ab)
    return text, env


def run_variants(args):
    variants = [parse_variant(v) for v in args.variants.split(";")]
    rows = args.rows.split(",")
    times = {(label, row): [] for label, _ in variants for row in rows}
    titles = {}
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for label, env in order:
            out = f"/tmp/dflash_bench_variant_{os.getpid()}.json"
            cmd = [sys.executable, os.path.abspath(__file__), "--rows", args.rows, "--iters", str(args.iters),
                   "--no-reference", "--json", out] + (["--tiny"] if args.tiny else [])
            print(f"=== round {rnd + 1}/{args.rounds}, variant {label}", flush=True)
            proc = subprocess.run(cmd, env={**os.environ, **env})
            if proc.returncode != 0:
                raise SystemExit(f"bench variant '{label}' failed with exit status {proc.returncode}")
            with open(out) as f:
                report = json.load(f)
            os.unlink(out)
            for r in report["rows"]:
                times[(label, r["row"])].append(r["ms"])
                titles[r["row"]] = (r["title"], r["floor_ms"])
    base = variants[0][0]
    print()
    print("| step | floor (ms) | " + " | ".join(f"{label} (ms)" for label, _ in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    table = []
    for row in rows:
        title, floor_ms = titles[row]
        base_ms = float(np.median(times[(base, row)]))
        cells, entry = [], {"row": row, "title": title, "floor_ms": floor_ms, "variants": {}}
        for label, _ in variants:
            t = times[(label, row)]
            med = float(np.median(t))
            entry["variants"][label] = {"median_ms": med, "runs_ms": t}
            spread = f" ({min(t):.3f}-{max(t):.3f})" if len(t) > 1 else ""
            ratio = "" if label == base else f", {med / base_ms:.3f}x"
            cells.append(f"{med:.3f}{spread}{ratio}")
        table.append(entry)
        print(f"| {title} | {floor_ms:.3f} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variants": [label for label, _ in variants], "rounds": args.rounds, "rows": table}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
