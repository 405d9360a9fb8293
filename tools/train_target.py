#!/usr/bin/env python3
"""Train the byte-level Qwen3 target of the embedded default pair (torch; a tools-only dependency).

    python tools/train_target.py --corpus DIR --out DIR [--budget-s 200 | --steps N] [--layers 8 --hidden 384 ...]

The corpus DIR comes from `train_common.build_corpus` (train_default.py builds it). Training goes over
non-overlapping windows of the train stream in a seeded order, none twice within a pass; no dropout (the corpus
is large enough that one pass is not finished in the default budget; should it be, a new pass starts in a new
order). bf16 autocast, fp32 master weights, AdamW, linear warmup then cosine decay to 10%. With --budget-s and no
--steps, the number of steps is fixed after a short timing probe (steps 5..15), and re-estimated at each
evaluation, so that training ends inside the budget; it is logged, and passing it back as --steps repeats the
run. Writes out/config.json + out/model.safetensors (bf16) and returns/prints the metrics.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_common as tc  # noqa: E402


def heldout_windows(heldout, seq_len, count, device):
    """A fixed set of `count` windows [count, seq_len + 1] spread evenly over the held-out stream."""
    n = len(heldout) - seq_len - 1
    count = max(1, min(count, n // (seq_len + 1)))
    starts = np.linspace(0, n, count, dtype=np.int64)
    windows = np.stack([heldout[s:s + seq_len + 1] for s in starts])
    return tc.bytes_to_ids(torch.from_numpy(windows).to(device))


@torch.no_grad()
def evaluate(model, windows, batch, device):
    """Mean next-byte cross-entropy (nats) over the windows, bf16 autocast on cuda."""
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, _ = model(w[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += w[:, 1:].numel()
    return total / count


def lr_at(step, total, peak, warmup, floor=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(corpus_dir, out_dir, *, shape=None, budget_s=200.0, steps=None, batch=128, seq_len=1024, lr=2e-3,
          warmup=100, weight_decay=0.1, seed=0, eval_every=250, heldout_windows_count=96, device=None,
          compile_model=False, state=None):
    """Returns the metrics dict; `state` (a dict) is filled as training goes so a caller can report a failure."""
    state = {} if state is None else state
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = shape or tc.TargetShape()
    t_start = time.time()
    torch.manual_seed(seed)
    train_bytes, heldout_bytes, _ = tc.load_corpus(corpus_dir)
    stream = torch.from_numpy(train_bytes).to(device)
    windows = heldout_windows(heldout_bytes, seq_len, heldout_windows_count, device)
    n_chunks = (len(train_bytes) - 1) // (seq_len + 1)
    order = torch.randperm(n_chunks, generator=torch.Generator().manual_seed(seed)).to(device)
    offsets = torch.arange(seq_len + 1, device=device)

    model = tc.TargetModel(shape)
    model.init_weights(torch.Generator().manual_seed(seed))
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    forward = torch.compile(model) if compile_model else model
    tc.log(f"target: {n_params / 1e6:.2f}M params, {shape}, batch {batch}x{seq_len}, {n_chunks} chunks "
           f"({len(train_bytes) / 1e6:.1f} MB), device {device}")
    state.update({"params": n_params, "shape": tc.to_jsonable(shape), "batch": batch, "seq_len": seq_len, "lr": lr,
                  "warmup": warmup, "weight_decay": weight_decay, "seed": seed, "train_chunks": n_chunks})

    total = steps
    auto = steps is None  # steps from timing: re-estimated at every evaluation
    probe_from, probe_t = 5, None
    history, running = [], None
    loss_sum, loss_count = torch.zeros((), device=device), 0
    step = cursor = passes = 0
    while True:
        if total is not None and step >= total:
            break
        if cursor + batch > n_chunks:  # a pass is done (not expected with the full corpus): a new order
            passes += 1
            order = torch.randperm(n_chunks, generator=torch.Generator().manual_seed(seed + passes)).to(device)
            cursor = 0
            tc.log(f"target: pass {passes + 1} over the corpus begins at step {step}")
        warm = warmup if total is None else min(warmup, max(1, total // 10))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total or 10**9, lr, warm)
        idx = order[cursor:cursor + batch]
        cursor += batch
        x = tc.bytes_to_ids(stream[(idx * (seq_len + 1))[:, None] + offsets])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, _ = forward(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_sum += loss.detach()
        loss_count += 1
        step += 1
        if step == probe_from:
            torch.cuda.synchronize() if device.type == "cuda" else None
            probe_t = time.time()
        if total is None and step == probe_from + 10:
            torch.cuda.synchronize() if device.type == "cuda" else None
            per_step = (time.time() - probe_t) / 10
            left = budget_s - (time.time() - t_start)
            total = max(step + 1, step + int(left / per_step))
            tc.log(f"target: {per_step * 1e3:.1f} ms/step ({batch * seq_len / per_step / 1e6:.2f} M tok/s) -> "
                   f"{total} steps")
            state["ms_per_step"] = per_step * 1e3
        if auto and total is not None and step % eval_every == 0 and step < total:
            torch.cuda.synchronize() if device.type == "cuda" else None
            per_step = (time.time() - probe_t) / (step - probe_from)
            estimate = max(step + 1, step + int((budget_s - (time.time() - t_start)) / per_step))
            if abs(estimate - total) > 0.05 * total:
                tc.log(f"target: {per_step * 1e3:.1f} ms/step so far -> {estimate} steps instead of {total}")
                total = estimate
        if step % eval_every == 0 or (total is not None and step == total):
            running, loss_sum, loss_count = float(loss_sum) / loss_count, torch.zeros((), device=device), 0
            held = evaluate(model, windows, 32, device)
            history.append({"step": step, "train_loss": running, "heldout_loss": held,
                            "seconds": round(time.time() - t_start, 1)})
            tc.log(f"target step {step}/{total}: train {running:.4f} heldout {held:.4f} nats/byte "
                   f"lr {opt.param_groups[0]['lr']:.2e}")
            state["history"] = history
        if total is None and time.time() - t_start > budget_s:
            break
        if time.time() - t_start > budget_s * 1.15:  # hard stop: the probe misjudged (e.g. evals)
            tc.log(f"target: over budget, stopping at step {step}")
            break
    state["steps"] = step
    if loss_count:
        running = float(loss_sum) / loss_count
    model = tc.bf16_rounded(model)  # what ships
    held = evaluate(model, windows, 32, device)
    tc.save_checkpoint(model, shape.hf_config(), out_dir)
    metrics = {**state, "steps": step, "final_train_loss": running, "final_heldout_loss_bf16": held,
               "tokens_seen": step * batch * seq_len, "epochs": step * batch / max(1, n_chunks),
               "seconds": round(time.time() - t_start, 1), "out": out_dir}
    tc.log(f"target: done, {step} steps, {metrics['tokens_seen'] / 1e6:.0f}M tokens "
           f"({metrics['epochs']:.2f} of the corpus), held-out {held:.4f} nats/byte (bf16 weights), saved {out_dir}")
    return metrics


def shape_args(p):
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1024)


def shape_from(args):
    return tc.TargetShape(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                          num_kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true")
    shape_args(p)
    args = p.parse_args(argv)
    metrics = train(args.corpus, args.out, shape=shape_from(args), budget_s=args.budget_s, steps=args.steps,
                    batch=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, seed=args.seed,
                    compile_model=args.compile)
    print(json.dumps(tc.to_jsonable(metrics), indent=1))


if __name__ == "__main__":
    main()
