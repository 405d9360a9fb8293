#!/usr/bin/env python3
"""Train the DFlash drafter of the embedded default pair against a frozen target (torch; tools only).

    python tools/train_drafter.py --target DIR --corpus DIR --out DIR [--budget-s 120 | --steps N]
    python tools/train_drafter.py --self-check [--target DIR --draft DIR --prompts FILE]   # needs transformers+dflash
    python tools/train_drafter.py --rollout-speed --target DIR --corpus DIR [--rollout-batch N]   # tokens/s only

The DFlash recipe, with blocks and labels that are exactly what greedy speculative decoding sees after a prompt:

1. Greedy rollouts (RolloutGenerator). Windows of --window-len bytes of the train stream ending right after a
   newline, each cut at --cuts-per-window of its line ends at least --min-prompt-len bytes in (prompts like the
   200..400-byte held-out prompts, which end with a newline; the cuts of a window share its prefill); the frozen
   target continues each greedily for --gen-len tokens. Batched (8192 prompts on a GPU), a static KV cache with
   per-row positions, the one-token step captured as a CUDA graph and replayed (checked equal to the eager step
   on the first held-out batch), fp32 logits. Every continuation token is the target's own greedy choice given
   everything before it: the context the drafter sees at inference (prompt + the target's greedy output), many
   prompts, short continuations.
2. Blocks. Per sequence --anchors anchor positions a in the continuation, always including its first token (the
   anchor of the first block after a prompt, the target's greedy successor of the prompt) and the rest at
   random with a + B - 1 inside it. Block input = [token at a, mask x (B-1)] at positions a..a+B-1; label of
   block row i (1..B-1) = token at a+i, what the target greedily generates i steps after the anchor.
3. Context. The target's hidden states after layers target_layer_ids (HF hidden_states[id + 1], concatenated) of
   the whole sequence, through the drafter's fc + hidden_norm; block j attends to context rows p < a_j (the rows
   dflash_generate has committed when it drafts from anchor a_j: the anchor's own row comes from the verify of
   that block) and to its own B rows, non-causally (train_common.DrafterModel / block_mask).
4. Loss. Cross-entropy of the target's lm_head over the drafter's final normed states (target embed_tokens and
   lm_head frozen, as the checkpoint borrows them), row i weighted by exp(-(i-1)/gamma). Batches go through the
   rollouts in a shuffled order, each once per epoch (no re-sampling with replacement).
5. Held-out measure and checkpoint choice (evaluate_heldout). Rollouts of held-out prompts drawn like the
   evaluation prompts from other held-out files (train_default.heldout_walk_prompts; standalone: windows of the
   held-out stream); the drafter's block at EVERY anchor of each continuation, then the walk greedy speculative
   decoding takes through it: first anchor = the first generated token, next anchor = anchor + accepted + 1 ...,
   stopping at EOS, for --walk-new-tokens tokens. Its tokens / verify steps is the mean acceptance length that
   dflash_generate / `pydflash bench` measure on such a prompt (the one approximation: the last block or two are
   scored as full blocks where inference drafts a shorter one). The mean of (accepted + 1) over uniformly
   drawn anchors ("block tau") is also reported but over-states acceptance: inference does not visit anchors
   uniformly; it jumps over easy stretches in one step and pays one step per token in hard ones, so its
   tokens / steps is a harmonic-type mean that weights the hard positions much more. The checkpoint with the
   best walk acceptance is the one saved.

Writes out/config.json + out/model.safetensors (bf16, no embed_tokens / lm_head). The number of steps comes from a
timing probe unless --steps is given; it is logged so the run can be repeated.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_common as tc  # noqa: E402
from train_target import lr_at  # noqa: E402


def _autocast(device, cache_enabled=True):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda",
                          cache_enabled=cache_enabled)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _fp32_logits(target, x):
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), target.lm_head.weight.float())


# ---------------------------------------------------------------------------------------------------------------
# rollouts
# ---------------------------------------------------------------------------------------------------------------

def excluded_mask(size, ranges):
    """[size + 1] cumulative count of excluded bytes (ranges: [(offset, length)]), for overlap tests."""
    bad = np.zeros(size, dtype=np.int64)
    for off, length in ranges or ():
        bad[max(0, off - 1):off + length] = 1  # the EOS before the file too
    return np.concatenate([[0], np.cumsum(bad)])


def sample_windows(stream, newlines, count, length, rng, excluded_cum=None):
    """[count, length] uint8 windows of `stream`, each ending right after a newline where one follows; windows
    holding an EOS (two files) or touching an excluded range (excluded_cum from excluded_mask) are drawn again
    (up to 8 times)."""
    ends = rng.integers(length, len(stream) - 1, size=count)
    redraw = np.ones(count, dtype=bool)
    for attempt in range(8):
        if len(newlines):
            pos = np.searchsorted(newlines, ends - 1)  # the first newline at or after ends - 1
            snapped = newlines[np.minimum(pos, len(newlines) - 1)] + 1
            ends = np.where(redraw & (pos < len(newlines)) & (snapped >= length), snapped, ends)
        windows = np.stack([stream[e - length:e] for e in ends])
        redraw = (windows == tc.EOS_BYTE).any(axis=1)
        if excluded_cum is not None:
            redraw |= excluded_cum[ends] - excluded_cum[ends - length] > 0
        if not redraw.any():
            break
        ends = np.where(redraw, rng.integers(length, len(stream) - 1, size=count), ends)
    return windows


def line_end_cuts(windows, per_window, min_len, rng):
    """[w, per_window] prompt lengths: distinct positions just after a newline of each window, at least
    min_len (the window's own end included; random other positions where a window has too few line ends)."""
    w, L = windows.shape
    cuts = np.empty((w, per_window), dtype=np.int64)
    for i in range(w):
        ends = np.flatnonzero(windows[i, min_len - 1:] == 10) + min_len
        if len(ends) < per_window:
            others = np.setdiff1d(np.arange(min_len, L + 1), ends)
            ends = np.concatenate([ends, rng.choice(others, per_window - len(ends), replace=False)])
        cuts[i] = rng.choice(ends, per_window, replace=False)
    return cuts


class RolloutGenerator:
    """Greedy continuations of the frozen target, gen_len tokens each, for a batch of prompts of any lengths up
    to max_prompt_len, several of which may share one prefill (prompts cut at different points of one window).

    A static KV cache [batch, kv_heads, max_prompt_len + gen_len, head_dim] (bf16 on a GPU) and static buffers:
    current tokens, per-row positions (a device tensor), output ids. The windows are prefilled in row chunks
    (causal attention, bf16 autocast, right-padded: later slots never change earlier ones) and their K/V rows
    copied to every prompt cut from them; then TargetModel.decode_one runs gen_len - 1 times over all slots with
    a -inf bias on each row's slots after its position (prompt slots past a cut are overwritten as it decodes):
    static shapes, no host sync, so on a GPU the step is captured once as a CUDA graph and replayed (its ~500
    kernels cost one launch). For a 12.8M-parameter target the step is memory-bound on the KV cache (8 layers x
    512 B per slot per sequence), hence the large batch. Logits fp32 (labels should not hinge on bf16 rounding
    of the logits)."""

    def __init__(self, target, batch, max_prompt_len, gen_len, device, graphs=True, prefill_tokens=2**19):
        self.target, self.batch, self.gen_len, self.device = target, batch, gen_len, device
        self.max_prompt_len = max_prompt_len
        self.cap = max_prompt_len + gen_len
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.cache = tc.KVCache(target.shape, batch, self.cap, device, dtype)
        self.out = torch.zeros(batch, self.cap, dtype=torch.long, device=device)
        self.tok = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.slots = torch.arange(self.cap, device=device)
        self.zero = torch.zeros((), device=device)
        self.neg_inf = torch.full((), float("-inf"), device=device)
        self.use_graphs = graphs and device.type == "cuda"
        self.graph = None
        self.prefill_tokens = prefill_tokens
        self.stats = {"batches": 0, "sequences": 0, "generated_tokens": 0, "prefill_tokens": 0, "prefill_s": 0.0,
                      "decode_s": 0.0, "decode_steps": 0, "graph_capture_s": 0.0}

    def _step(self):
        bias = torch.where(self.slots[None, :] <= self.pos[:, None], self.zero, self.neg_inf)
        with _autocast(self.device, cache_enabled=False):
            logits = self.target.decode_one(self.tok, self.pos, self.cache, bias)
        nxt = logits.argmax(-1)
        self.pos.add_(1)
        self.tok.copy_(nxt)
        self.out.scatter_(1, self.pos[:, None], nxt[:, None])

    def _graph(self):
        if self.graph is not None:
            return self.graph
        t0 = time.time()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (allocations, kernel choices) on a side stream, as torch asks
            for _ in range(2):
                self.pos.zero_()
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.pos.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        torch.cuda.synchronize()
        self.graph = graph
        self.stats["graph_capture_s"] += time.time() - t0
        return graph

    @torch.no_grad()
    def generate(self, windows, cuts, graphs=None):
        """windows [w, L] int64 on the device (L <= max_prompt_len), cuts [w, R] prompt lengths (1..L) with
        w * R <= batch. Returns (seqs [w * R, L + gen_len], lens [w * R]): row j * w + i is window i cut at
        cuts[i, j] followed by its gen_len greedy tokens (seqs[r, :lens[r] + gen_len] is the sequence; what
        follows is padding)."""
        w, L = windows.shape
        R = cuts.shape[1]
        n = w * R
        assert n <= self.batch and L <= self.max_prompt_len, (w, R, L, self.batch, self.max_prompt_len)
        use_graphs = self.use_graphs if graphs is None else graphs
        graph = self._graph() if use_graphs else None  # before the prefill: the warm-up writes the buffers
        _sync(self.device)
        t0 = time.time()
        lens = cuts.t().reshape(-1)                                             # row j * w + i
        first = torch.empty(w, R, dtype=torch.long, device=self.device)
        rows = max(1, min(w, self.prefill_tokens // L))
        with _autocast(self.device):
            for r in range(0, w, rows):
                e = min(w, r + rows)
                x, _ = self.target(windows[r:e], cache=self.cache.view(rows=slice(r, e)), logits=False)
                last = x.gather(1, (cuts[r:e] - 1)[:, :, None].expand(-1, -1, x.shape[-1]))    # [rows, R, H]
                first[r:e] = _fp32_logits(self.target, last).argmax(-1)
        for j in range(1, R):  # the other cuts of each window: the same prefix K/V
            for k, v in zip(self.cache.k, self.cache.v):
                k[j * w:(j + 1) * w, :, :L] = k[:w, :, :L]
                v[j * w:(j + 1) * w, :, :L] = v[:w, :, :L]
        self.out[:n, :L] = windows.repeat(R, 1)
        self.pos.zero_()
        self.tok.zero_()
        self.pos[:n] = lens
        self.tok[:n] = first.t().reshape(-1)
        self.out[:n].scatter_(1, lens[:, None], self.tok[:n, None])
        _sync(self.device)
        t1 = time.time()
        for _ in range(self.gen_len - 1):
            graph.replay() if graph is not None else self._step()
        result = self.out[:n, :L + self.gen_len].clone()
        _sync(self.device)
        t2 = time.time()
        st = self.stats
        st["batches"] += 1
        st["sequences"] += n
        st["generated_tokens"] += n * self.gen_len
        st["prefill_tokens"] += w * L
        st["prefill_s"] += t1 - t0
        st["decode_s"] += t2 - t1
        st["decode_steps"] += self.gen_len - 1
        return result, lens.clone()

    def validate(self, windows, cuts):
        """Eager and graph steps give the same tokens here (graphs are dropped if not); returns (result, report)."""
        t0 = time.time()
        eager = self.generate(windows, cuts, graphs=False)
        report = {"graphs": self.use_graphs, "eager_s": round(time.time() - t0, 3)}
        if self.use_graphs:
            try:
                t0 = time.time()
                graphed, _ = self.generate(windows, cuts, graphs=True)
                report["graph_s_with_capture"] = round(time.time() - t0, 3)
                same = float((graphed == eager[0]).float().mean())
                report["graph_equal_fraction"] = same
                if same < 1.0:
                    self.use_graphs = False
                    tc.log(f"rollouts: CUDA-graph step differs from the eager step ({same:.6f} equal), eager only")
            except Exception as e:  # noqa: BLE001 - any capture failure: eager is correct, only slower
                self.use_graphs = False
                report["graph_error"] = f"{type(e).__name__}: {e}"
                tc.log(f"rollouts: CUDA-graph capture failed ({report['graph_error']}), eager only")
            report["graphs"] = self.use_graphs
        return eager, report

    def speed(self):
        st = self.stats
        total = st["prefill_s"] + st["decode_s"]
        return {**{k: round(v, 3) if isinstance(v, float) else v for k, v in st.items()},
                "generated_tok_per_s": st["generated_tokens"] / max(total, 1e-9),
                "decode_ms_per_step": 1e3 * st["decode_s"] / max(1, st["decode_steps"]),
                "decode_tok_per_s": self.batch * st["decode_steps"] / max(st["decode_s"], 1e-9),
                "prefill_tok_per_s": st["prefill_tokens"] / max(st["prefill_s"], 1e-9)}


def repeat_fraction(seqs, lens, gen_len, n=8, limit=256):
    """Fraction of continuation tokens whose n-gram (ending there) already occurred earlier in the sequence: how
    repetitive (loop-like, hence easy to draft) the greedy continuations are."""
    hits = total = 0
    for row, lp in zip(seqs[:limit].tolist(), lens[:limit].tolist()):
        seen = {tuple(row[i - n:i]) for i in range(n, lp + 1)}
        for i in range(lp + 1, lp + gen_len + 1):
            gram = tuple(row[i - n:i])
            hits += gram in seen
            total += 1
            seen.add(gram)
    return hits / max(1, total)


def make_rollouts(gen, stream_np, *, window_len, min_prompt_len, cuts_per_window, seed, deadline, max_rollouts,
                  label, excluded=None, validate=True):
    """Rollouts of prompts cut at line ends of windows of the stream (cuts_per_window per window, lengths
    min_prompt_len..window_len), a generator batch at a time, until the deadline (a batch is started only when
    the last one's time still fits) or max_rollouts. Returns ((int16 seqs [k, window_len + gen_len], int16 lens
    [k]), stats)."""
    rng = np.random.default_rng(seed)
    newlines = np.flatnonzero(stream_np == 10)
    excluded_cum = excluded_mask(len(stream_np), excluded) if excluded else None
    seqs, lens, made, i, last, report = [], [], 0, 0, 0.0, {}
    t0 = time.time()
    w_max = gen.batch // cuts_per_window
    while made < max_rollouts and (i == 0 or time.time() + last < deadline):
        tb = time.time()
        w = max(1, min(w_max, (max_rollouts - made) // cuts_per_window))
        win = sample_windows(stream_np, newlines, w, window_len, rng, excluded_cum)
        cuts = torch.from_numpy(line_end_cuts(win, cuts_per_window, min_prompt_len, rng)).to(gen.device)
        ids = tc.bytes_to_ids(torch.from_numpy(win).to(gen.device))
        if i == 0 and validate:
            (s, ln), report = gen.validate(ids, cuts)
        else:
            s, ln = gen.generate(ids, cuts)
        seqs.append(s.to(torch.int16))
        lens.append(ln.to(torch.int16))
        made += s.shape[0]
        i += 1
        last = time.time() - tb
        if i <= 2 or i % 8 == 0:
            sp = gen.speed()
            tc.log(f"{label} rollouts: {made} x {gen.gen_len} ({sp['generated_tok_per_s'] / 1e3:.0f}k generated "
                   f"tok/s; prefill {sp['prefill_tok_per_s'] / 1e6:.2f} M tok/s, decode "
                   f"{sp['decode_ms_per_step']:.2f} ms/step = {sp['decode_tok_per_s'] / 1e3:.0f}k tok/s; "
                   f"{time.time() - t0:.1f} s)")
    data = (torch.cat(seqs), torch.cat(lens))
    stats = {"rollouts": made, "seconds": round(time.time() - t0, 1), "speed": gen.speed(), "validation": report,
             "repeat_fraction_8gram": repeat_fraction(data[0], data[1], gen.gen_len)}
    return data, stats


def rollouts_from_prompts(gen, prompts, label):
    """Rollouts of given prompts (bytes, each at most gen.max_prompt_len long), at their own lengths (right-padded
    windows, one cut each). Returns ((seqs, lens), stats) as make_rollouts."""
    t0, report, seqs, lens = time.time(), {}, [], []
    for i in range(0, len(prompts), gen.batch):
        chunk = prompts[i:i + gen.batch]
        L = max(len(p) for p in chunk)
        win = np.full((len(chunk), L), 10, dtype=np.uint8)
        for r, p in enumerate(chunk):
            win[r, :len(p)] = np.frombuffer(bytes(p), dtype=np.uint8)
        ids = tc.bytes_to_ids(torch.from_numpy(win).to(gen.device))
        cuts = torch.tensor([[len(p)] for p in chunk], device=gen.device)
        if not report:
            (s, ln), report = gen.validate(ids, cuts)
        else:
            s, ln = gen.generate(ids, cuts)
        width = gen.max_prompt_len + gen.gen_len
        seqs.append(F.pad(s, (0, width - s.shape[1]), value=10).to(torch.int16))
        lens.append(ln.to(torch.int16))
    data = (torch.cat(seqs), torch.cat(lens))
    sp = gen.speed()
    tc.log(f"{label} rollouts: {data[0].shape[0]} x {gen.gen_len} from prompts of {int(data[1].min())}.."
           f"{int(data[1].max())} bytes ({sp['generated_tok_per_s'] / 1e3:.0f}k generated tok/s, "
           f"{time.time() - t0:.1f} s)")
    return data, {"rollouts": data[0].shape[0], "seconds": round(time.time() - t0, 1), "speed": sp,
                  "validation": report, "repeat_fraction_8gram": repeat_fraction(data[0], data[1], gen.gen_len)}


# ---------------------------------------------------------------------------------------------------------------
# blocks, loss, held-out measures
# ---------------------------------------------------------------------------------------------------------------

def block_batch(lens, anchors_per_seq, block_size, gen_len, generator, first=True):
    """Anchors [b, N] in each continuation (positions lens .. lens + gen_len - B), sorted per row, drawn without
    replacement; with `first`, always lens itself (the first block after the prompt) among them."""
    span = gen_len - block_size + 1
    n = min(anchors_per_seq, span)
    scores = torch.rand(lens.shape[0], span, generator=generator, device="cpu")
    if first:
        scores[:, 0] = 2.0
    return scores.to(lens.device).topk(n, dim=1).indices.sort(dim=1).values + lens[:, None]


def target_features(target, seqs, layer_ids, device):
    with torch.no_grad(), _autocast(device):
        _, features = target(seqs, capture=tuple(layer_ids), logits=False)
    return features


def drafter_loss(target, drafter, seqs, anchors, gamma, device, features=None):
    """(weighted loss, correct [b, N, B-1] bool) for the blocks at `anchors` of `seqs`."""
    B = drafter.shape.block_size
    b, N = anchors.shape
    T = seqs.shape[1]
    if features is None:
        features = target_features(target, seqs, drafter.shape.target_layer_ids, device)
    steps = torch.arange(B, device=device)
    rows = (anchors[:, :, None] + steps).reshape(b, N * B)                       # positions of block rows
    block_ids = torch.full((b, N, B), tc.MASK_TOKEN_ID, dtype=torch.long, device=device)
    block_ids[:, :, 0] = seqs.gather(1, anchors)
    labels = seqs.gather(1, rows).view(b, N, B)[:, :, 1:]
    noise = target.model.embed_tokens(block_ids.view(b, N * B)).detach()
    mask = tc.block_mask(anchors, T, B)
    with _autocast(device):
        hidden = drafter(features, noise, rows, mask).view(b, N, B, -1)[:, :, 1:]
        logits = target.lm_head(hidden)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         reduction="none").view(b, N, B - 1)
    weights = torch.exp(-torch.arange(B - 1, device=device, dtype=torch.float32) / gamma)
    loss = (ce * weights).sum(-1).mean() / weights.sum()
    return loss, logits.argmax(-1) == labels


def acceptance_stats(correct):
    """From correct [.., B-1]: (per-position accuracy list, mean accepted+1 of blocks at these anchors)."""
    c = correct.reshape(-1, correct.shape[-1]).float()
    accepted = c.cumprod(-1).sum(-1)
    return c.mean(0).tolist(), float(accepted.mean()) + 1.0


def speculative_walk(accepted, continuation, max_new_tokens, block_size, stop_id=tc.EOS_TOKEN_ID):
    """What greedy speculative decoding does on these continuations, given the drafter's accepted count at every
    anchor. accepted [n, A]: leading draft tokens equal to the continuation for a full block anchored at
    continuation index k (index 0 = the first generated token, the first anchor); continuation [n, >= A + B - 1]
    the target's greedy tokens. Steps as dflash_generate: produced = min(accepted + 1, room), the next anchor
    `produced` further, a stop token ends the sequence. Returns (new tokens incl. the first, steps, histogram of
    accepted per step [B]) summed over the sequences; new tokens / steps is the mean acceptance length that
    `train_default.evaluate` and tests/test_default_model.py compute."""
    n, A = accepted.shape
    M = min(max_new_tokens, A + 1)
    G = continuation.shape[1]
    idx = torch.arange(G)
    is_stop = continuation == stop_id
    stop_at = torch.where(is_stop & (idx >= 1), idx, G + 1).min(dim=1).values
    start = torch.zeros(n, dtype=torch.long)
    active = ~is_stop[:, 0]
    rows = torch.arange(n)
    steps = tokens = 0
    hist = torch.zeros(block_size, dtype=torch.long)
    new_tokens = n  # the first token of every sequence comes from the prefill
    while bool(active.any()):
        acc = accepted[rows, start.clamp(max=A - 1)]
        acc = torch.minimum(acc, (M - start).clamp(max=block_size) - 1)
        produced = torch.minimum(acc + 1, M - start - 1)
        hit = (stop_at > start) & (stop_at <= start + produced)
        produced = torch.where(hit, stop_at - start, produced)
        steps += int(active.sum())
        tokens += int((produced * active).sum())
        hist += torch.bincount(acc[active], minlength=block_size)[:block_size]
        start = start + produced * active
        active = active & ~hit & (start + 1 < M)
    return new_tokens + tokens, steps, hist


@torch.no_grad()
def evaluate_heldout(target, drafter, held, gamma, device, gen_len, walk_new_tokens=64, batch=32, anchor_chunk=48):
    """The drafter's block at every anchor of every held-out continuation (held = (seqs, lens) from
    make_rollouts / rollouts_from_prompts): loss and per-position accuracy (uniform anchors), block tau (mean
    accepted + 1 over uniform anchors), and the speculative walk's mean acceptance (new tokens / steps, what
    inference measures) with its acceptance rate by position."""
    B = drafter.shape.block_size
    A = gen_len - B + 1
    seqs, lens = held
    loss_sum = loss_n = 0.0
    corrects, tokens, steps = [], 0, 0
    hist = torch.zeros(B, dtype=torch.long)
    for i in range(0, seqs.shape[0], batch):
        lp = lens[i:i + batch].long()
        s = seqs[i:i + batch, :int(lp.max()) + gen_len].long()
        feats = target_features(target, s, drafter.shape.target_layer_ids, device)
        parts = []
        for a0 in range(0, A, anchor_chunk):
            anchors = lp[:, None] + torch.arange(a0, min(A, a0 + anchor_chunk), device=device)
            loss, correct = drafter_loss(target, drafter, s, anchors, gamma, device, features=feats)
            loss_sum += float(loss) * anchors.numel()
            loss_n += anchors.numel()
            parts.append(correct.cpu())
        correct = torch.cat(parts, dim=1)                                      # [b, A, B-1]
        corrects.append(correct.reshape(-1, B - 1))
        accepted = correct.long().cumprod(-1).sum(-1)
        continuation = s.gather(1, lp[:, None] + torch.arange(gen_len, device=device)).cpu()
        t, st, h = speculative_walk(accepted, continuation, walk_new_tokens, B)
        tokens, steps, hist = tokens + t, steps + st, hist + h
    per_pos, tau = acceptance_stats(torch.cat(corrects))
    at_least = hist.flip(0).cumsum(0).flip(0)  # steps with accepted >= i
    return {"loss": loss_sum / max(1, loss_n), "block_tau": tau, "accuracy_by_position": per_pos,
            "walk_acceptance": tokens / max(1, steps), "walk_tokens": tokens, "walk_steps": steps,
            "walk_new_tokens": walk_new_tokens,
            "walk_rate_by_position": (at_least[1:].float() / max(1, steps)).tolist()}


def train(target_dir, corpus_dir, out_dir, *, shape=None, budget_s=120.0, steps=None, rollout_fraction=0.3,
          max_rollouts=500_000, rollout_batch=None, window_len=400, min_prompt_len=192, cuts_per_window=4,
          gen_len=96, batch=128, anchors_per_seq=32, lr=2e-3, warmup=50, weight_decay=0.01, gamma=None, seed=1,
          eval_every=200, heldout_rollouts=512, walk_new_tokens=64, heldout_prompts=None, heldout_exclude=None,
          first_anchor=True, graphs=True, device=None, state=None):
    """Train prompts: cuts_per_window line ends (min_prompt_len..window_len bytes in) of each window of the train
    stream, sharing its prefill. heldout_prompts: prompts (bytes, at most window_len long) for the held-out
    measure, drawn like the evaluation prompts from other held-out files (train_default.heldout_walk_prompts),
    continued at their own lengths; without them, `heldout_rollouts` windows of the held-out stream, cut at
    their end, avoiding heldout_exclude [(offset, length)] (the evaluation prompts' files)."""
    state = {} if state is None else state
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = shape or tc.DrafterShape()
    B = shape.block_size
    gamma = gamma or {16: 7.0, 10: 5.0, 8: 4.0}.get(B, B / 2)
    rollout_batch = rollout_batch or (8192 if device.type == "cuda" else 64)
    if gen_len < B + 1:
        raise ValueError(f"gen_len {gen_len} must exceed the block size {B}")
    t_start = time.time()
    torch.manual_seed(seed)
    target = tc.load_target(target_dir).to(device).eval().requires_grad_(False)
    tshape = target.shape
    if max(shape.target_layer_ids) >= tshape.num_layers:
        raise ValueError(f"target_layer_ids {shape.target_layer_ids} beyond the target's {tshape.num_layers} layers")
    train_bytes, heldout_bytes, _ = tc.load_corpus(corpus_dir)
    state.update({"shape": tc.to_jsonable(shape), "gamma": gamma, "seed": seed, "batch": batch,
                  "anchors_per_seq": anchors_per_seq, "lr": lr, "gen_len": gen_len, "window_len": window_len,
                  "min_prompt_len": min_prompt_len, "cuts_per_window": cuts_per_window,
                  "rollout_batch": rollout_batch, "walk_new_tokens": walk_new_tokens})

    # Held-out rollouts first, with a small generator: its first batch also checks the CUDA-graph step.
    heldout_prompts = [p for p in heldout_prompts or () if 0 < len(p) <= window_len]
    if heldout_prompts:
        hgen = RolloutGenerator(target, min(256, len(heldout_prompts)), window_len, gen_len, device, graphs=graphs)
        held, hstats = rollouts_from_prompts(hgen, heldout_prompts, "held-out")
    else:
        hgen = RolloutGenerator(target, min(256, heldout_rollouts), window_len, gen_len, device, graphs=graphs)
        held, hstats = make_rollouts(hgen, heldout_bytes, window_len=window_len, min_prompt_len=window_len,
                                     cuts_per_window=1, seed=seed + 1000, deadline=float("inf"),
                                     max_rollouts=heldout_rollouts, label="held-out", excluded=heldout_exclude)
    graphs = graphs and hgen.use_graphs
    del hgen
    state["heldout_rollouts"] = hstats
    deadline = t_start + budget_s * rollout_fraction
    gen = RolloutGenerator(target, rollout_batch, window_len, gen_len, device, graphs=graphs)
    data, gstats = make_rollouts(gen, train_bytes, window_len=window_len, min_prompt_len=min_prompt_len,
                                 cuts_per_window=cuts_per_window, seed=seed, deadline=deadline,
                                 max_rollouts=max_rollouts, label="train", validate=False)
    del gen
    if device.type == "cuda":
        torch.cuda.empty_cache()
    seqs, lens = data
    n_rollouts = seqs.shape[0]
    state.update({"rollouts": n_rollouts, "train_rollouts": gstats,
                  "rollout_seconds": round(time.time() - t_start, 1)})
    tc.log(f"drafter: {n_rollouts} train rollouts x {gen_len} tokens ({n_rollouts * gen_len / 1e6:.1f} M generated "
           f"tokens at {gstats['speed']['generated_tok_per_s'] / 1e3:.0f}k tok/s), {hstats['rollouts']} held-out, "
           f"{state['rollout_seconds']} s; CUDA graphs {graphs} ({hstats['validation']}); 8-gram repeats in the "
           f"continuations: train {gstats['repeat_fraction_8gram']:.3f}, held-out "
           f"{hstats['repeat_fraction_8gram']:.3f}")

    drafter = tc.DrafterModel(shape, tshape)
    drafter.init_weights(torch.Generator().manual_seed(seed))
    drafter.to(device)
    n_params = sum(p.numel() for p in drafter.parameters())
    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    no_decay = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    tc.log(f"drafter: {n_params / 1e6:.2f}M params, {shape}, gamma {gamma}, batch {batch} seqs x {anchors_per_seq} "
           f"blocks")
    state["params"] = n_params

    def heldout_eval(step, train_loss, train_tau):
        h = evaluate_heldout(target, drafter, held, gamma, device, gen_len, walk_new_tokens)
        row = {"step": step, "train_loss": train_loss, "train_block_tau": train_tau, "heldout_loss": h["loss"],
               "heldout_block_tau": h["block_tau"], "heldout_walk_acceptance": h["walk_acceptance"],
               "seconds": round(time.time() - t_start, 1)}
        tc.log(f"drafter step {step}/{total}: train {train_loss:.4f} (block tau {train_tau:.2f}) held-out "
               f"{h['loss']:.4f} (block tau {h['block_tau']:.2f}, WALK ACCEPTANCE {h['walk_acceptance']:.3f}; acc@1 "
               f"{h['accuracy_by_position'][0]:.3f}, walk rate@1..4 "
               f"{[round(x, 3) for x in h['walk_rate_by_position'][:4]]})")
        return row, h

    rng = np.random.default_rng(seed)
    gen_t = torch.Generator().manual_seed(seed)
    t_train = time.time()
    budget_left = budget_s - (t_train - t_start)
    total, probe_from, probe_t = steps, 5, None
    auto = steps is None  # steps from timing: re-estimated at every evaluation
    history, best = [], {"walk_acceptance": -1.0, "step": 0, "state": None}
    loss_sum, loss_count, correct_acc = torch.zeros((), device=device), 0, []
    step = epoch = 0
    order = []
    while total is None or step < total:
        if not order:  # an epoch: every rollout once, in a new order
            perm = rng.permutation(n_rollouts)
            order = [perm[i:i + batch] for i in range(0, max(1, n_rollouts - batch + 1), batch)]
            epoch += 1
            if epoch > 1:
                tc.log(f"drafter: epoch {epoch} over the rollouts begins at step {step}")
        idx = torch.from_numpy(order.pop()).to(device)
        warm = warmup if total is None else min(warmup, max(1, total // 10))
        for pg in opt.param_groups:
            pg["lr"] = lr_at(step, total or 10**9, lr, warm)
        lp = lens[idx].long()
        s = seqs[idx, :int(lp.max()) + gen_len].long()
        anchors = block_batch(lp, anchors_per_seq, B, gen_len, gen_t, first=first_anchor)
        loss, correct = drafter_loss(target, drafter, s, anchors, gamma, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        loss_sum += loss.detach()
        loss_count += 1
        correct_acc.append(correct.detach().reshape(-1, B - 1)[:256])
        step += 1
        if step == probe_from:
            _sync(device)
            probe_t = time.time()
        if total is None and step == probe_from + 10:
            _sync(device)
            per_step = (time.time() - probe_t) / 10
            left = budget_left - (time.time() - t_train)
            total = max(step + 1, step + int(left / per_step))
            tc.log(f"drafter: {per_step * 1e3:.1f} ms/step -> {total} steps")
            state["ms_per_step"] = per_step * 1e3
        if auto and total is not None and step % eval_every == 0 and step < total:
            _sync(device)
            per_step = (time.time() - probe_t) / (step - probe_from)
            estimate = max(step + 1, step + int((budget_left - (time.time() - t_train)) / per_step))
            if abs(estimate - total) > 0.03 * total:
                tc.log(f"drafter: {per_step * 1e3:.1f} ms/step so far -> {estimate} steps instead of {total}")
                total = estimate
        over = time.time() - t_start > budget_s * 1.05
        if step % eval_every == 0 or step == total or over:
            running = float(loss_sum) / loss_count
            _, train_tau = acceptance_stats(torch.cat(correct_acc))
            loss_sum, loss_count, correct_acc = torch.zeros((), device=device), 0, []
            row, _ = heldout_eval(step, running, train_tau)
            history.append(row)
            state["history"] = history
            if row["heldout_walk_acceptance"] >= best["walk_acceptance"]:  # ties: the later (more trained) one
                best = {"walk_acceptance": row["heldout_walk_acceptance"], "step": step,
                        "state": {k: v.detach().clone() for k, v in drafter.state_dict().items()}}
        if over:
            tc.log(f"drafter: over budget, stopping at step {step}")
            break
    state.update({"steps": step, "epochs": epoch, "best_step": best["step"],
                  "sequences_seen": step * batch, "rollouts_per_epoch": n_rollouts})
    if best["state"] is not None:
        drafter.load_state_dict(best["state"])
    tc.log(f"drafter: keeping step {best['step']} (held-out walk acceptance {best['walk_acceptance']:.3f}) of {step}")
    drafter = tc.bf16_rounded(drafter)
    final = evaluate_heldout(target, drafter, held, gamma, device, gen_len, walk_new_tokens)
    tc.save_checkpoint(drafter, shape.hf_config(tshape), out_dir)
    metrics = {**state, "final_train_loss": history[-1]["train_loss"] if history else None,
               "final_heldout_loss_bf16": final["loss"], "heldout_block_tau_bf16": final["block_tau"],
               "heldout_walk_acceptance_bf16": final["walk_acceptance"],
               "heldout_walk_rate_by_position_bf16": final["walk_rate_by_position"],
               "heldout_block_accuracy_by_position": final["accuracy_by_position"],
               "seconds": round(time.time() - t_start, 1), "out": out_dir}
    tc.log(f"drafter: done, {step} steps ({step * batch / max(1, n_rollouts):.2f} epochs), kept step {best['step']}: "
           f"held-out walk acceptance {final['walk_acceptance']:.3f}, block tau {final['block_tau']:.2f}, loss "
           f"{final['loss']:.4f} (bf16 weights), saved {out_dir}")
    return metrics


def rollout_speed(target_dir, corpus_dir, *, batch, gen_len=96, window_len=400, min_prompt_len=192,
                  cuts_per_window=4, batches=3, graphs=True, device=None):
    """Tokens/s of RolloutGenerator alone (and its eager-vs-graph check) for this target."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = tc.load_target(target_dir).to(device).eval().requires_grad_(False)
    train_bytes, _, _ = tc.load_corpus(corpus_dir)
    gen = RolloutGenerator(target, batch, window_len, gen_len, device, graphs=graphs)
    _, stats = make_rollouts(gen, train_bytes, window_len=window_len, min_prompt_len=min_prompt_len,
                             cuts_per_window=cuts_per_window, seed=0, deadline=float("inf"),
                             max_rollouts=batch * batches, label="speed")
    return stats


# ---------------------------------------------------------------------------------------------------------------
# self-check against the references (transformers Qwen3ForCausalLM, dflash.model.DFlashDraftModel / dflash_generate)
# ---------------------------------------------------------------------------------------------------------------

def self_check(target_dir=None, draft_dir=None, prompts=None, max_new_tokens=48, seed=0):
    """Our target == transformers' and our batched, masked drafter forward == DFlashDraftModel, in fp32 on CPU;
    our speculative_generate == dflash_generate (tokens and acceptance lengths). Random tiny models unless
    target_dir/draft_dir are given. Returns a dict of errors and counts; raises AssertionError on a mismatch."""
    import transformers
    from dflash import model as dfm

    torch.manual_seed(seed)
    tmp = tempfile.mkdtemp(prefix="draft_selfcheck_")
    if target_dir is None:
        tshape = tc.TargetShape(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                intermediate_size=96)
        dshape = tc.DrafterShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=80,
                                 block_size=8, target_layer_ids=[0, 2, 3])
        t = tc.TargetModel(tshape)
        t.init_weights(torch.Generator().manual_seed(seed))
        with torch.no_grad():  # random norms so they are not a no-op
            for name, p in t.named_parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn(p.shape))
        d = tc.DrafterModel(dshape, tshape)
        d.init_weights(torch.Generator().manual_seed(seed + 1))
        with torch.no_grad():
            for p in d.parameters():
                p.mul_(5.0) if p.dim() >= 2 else p.add_(0.1 * torch.randn(p.shape))
        target_dir = tc.save_checkpoint(tc.bf16_rounded(t), tshape.hf_config(), os.path.join(tmp, "target"))
        draft_dir = tc.save_checkpoint(tc.bf16_rounded(d), dshape.hf_config(tshape), os.path.join(tmp, "draft"))
    ours_t = tc.load_target(target_dir).eval()
    ours_d = tc.load_drafter(draft_dir, ours_t.shape).eval()
    ref_t = transformers.Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ref_d = dfm.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    ids_list = list(range(0, 250, 3))[:70]
    ids = torch.tensor([ids_list])
    report = {}
    with torch.no_grad():
        out = ref_t(ids, output_hidden_states=True)
        ref_feats = dfm.extract_context_feature(out.hidden_states, ref_d.target_layer_ids)
        logits, feats = ours_t(ids, capture=tuple(ours_d.shape.target_layer_ids))
        report["target_logits_rel_err"] = float((logits - out.logits).norm() / out.logits.norm())
        report["target_features_rel_err"] = float((feats - ref_feats).norm() / ref_feats.norm())
        # Many blocks at once under the training mask vs one reference call per block.
        B, T = ours_d.shape.block_size, ids.shape[1]
        anchors = torch.tensor([[1, 9, 30, T - B]])
        rows = (anchors[:, :, None] + torch.arange(B)).reshape(1, -1)
        block_ids = torch.full((1, anchors.shape[1], B), tc.MASK_TOKEN_ID)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        noise = ours_t.model.embed_tokens(block_ids.view(1, -1))
        ours = ours_d(feats, noise, rows, tc.block_mask(anchors, T, B)).view(1, anchors.shape[1], B, -1)
        worst = 0.0
        for j, a in enumerate(anchors[0].tolist()):
            ref = ref_d(target_hidden=ref_feats[:, :a], noise_embedding=noise.view(1, -1, B, noise.shape[-1])[:, j],
                        position_ids=torch.arange(0, a + B)[None], past_key_values=None, use_cache=False)
            worst = max(worst, float((ours[:, j] - ref).norm() / ref.norm()))
            ours_logits = ours_t.lm_head(ours[:, j, 1:])
            ref_logits = ref_d.compute_logits(ref[:, 1:], dfm._output_head(ref_t))
            assert torch.equal(ours_logits.argmax(-1), ref_logits.argmax(-1)) or worst < 1e-5
        report["drafter_hidden_rel_err"] = worst
    assert report["target_logits_rel_err"] < 1e-5, report
    assert report["target_features_rel_err"] < 1e-5, report
    assert report["drafter_hidden_rel_err"] < 1e-5, report
    # Whole generations: our torch loop vs dflash_generate.
    prompt_ids = [list(p.encode()) for p in (prompts or ["def main(argv):\n    ", "import os\nimport sys\n"])]
    same, mean_ours, mean_ref = 0, [], []
    cuda_time, dfm._cuda_time = dfm._cuda_time, time.perf_counter
    try:
        for p in prompt_ids:
            new, lengths = tc.speculative_generate(ours_t, ours_d, p, max_new_tokens)
            stats = dfm.dflash_generate(ref_d, ref_t, torch.tensor([p]), max_new_tokens, [tc.EOS_TOKEN_ID],
                                        return_stats=True)
            ref_new = stats.output_ids[0, len(p):].tolist()
            same += int(new == ref_new and lengths == list(stats.acceptance_lengths))
            mean_ours += lengths
            mean_ref += list(stats.acceptance_lengths)
    finally:
        dfm._cuda_time = cuda_time
    report.update({"generations_identical": f"{same}/{len(prompt_ids)}",
                   "mean_acceptance_ours": sum(mean_ours) / max(1, len(mean_ours)),
                   "mean_acceptance_reference": sum(mean_ref) / max(1, len(mean_ref))})
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target")
    p.add_argument("--corpus")
    p.add_argument("--out")
    p.add_argument("--draft", help="with --self-check: a trained drafter to check")
    p.add_argument("--prompts", help="with --self-check: prompts.json")
    p.add_argument("--self-check", action="store_true")
    p.add_argument("--budget-s", type=float, default=120.0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--target-layer-ids", default="1,4,7")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=96)
    p.add_argument("--window-len", type=int, default=400, help="bytes of train text per prefill")
    p.add_argument("--min-prompt-len", type=int, default=192)
    p.add_argument("--cuts-per-window", type=int, default=4, help="prompts (line ends) per window")
    p.add_argument("--rollout-batch", type=int, default=None, help="default 8192 on a GPU, 64 on the CPU")
    p.add_argument("--rollout-fraction", type=float, default=0.3)
    p.add_argument("--walk-new-tokens", type=int, default=64)
    p.add_argument("--no-graphs", action="store_true", help="eager rollout steps (no CUDA graphs)")
    p.add_argument("--rollout-speed", action="store_true", help="only measure rollout tokens/s")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.self_check:
        prompts = None
        if args.prompts:
            with open(args.prompts) as f:
                prompts = json.load(f)["prompts"][:4]
        print(json.dumps(self_check(args.target, args.draft, prompts), indent=1))
        return
    if args.rollout_speed:
        if not (args.target and args.corpus):
            p.error("--rollout-speed needs --target and --corpus")
        stats = rollout_speed(args.target, args.corpus, batch=args.rollout_batch or 64, gen_len=args.gen_len,
                              window_len=args.window_len, min_prompt_len=args.min_prompt_len,
                              cuts_per_window=args.cuts_per_window, graphs=not args.no_graphs)
        print(json.dumps(tc.to_jsonable(stats), indent=1))
        return
    if not (args.target and args.corpus and args.out):
        p.error("--target, --corpus and --out are required (or --self-check)")
    shape = tc.DrafterShape(num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                            head_dim=args.head_dim, intermediate_size=args.intermediate, block_size=args.block_size,
                            target_layer_ids=[int(x) for x in args.target_layer_ids.split(",")])
    metrics = train(args.target, args.corpus, args.out, shape=shape, budget_s=args.budget_s, steps=args.steps,
                    batch=args.batch, anchors_per_seq=args.anchors, gen_len=args.gen_len, window_len=args.window_len,
                    min_prompt_len=args.min_prompt_len, cuts_per_window=args.cuts_per_window,
                    rollout_batch=args.rollout_batch, rollout_fraction=args.rollout_fraction,
                    walk_new_tokens=args.walk_new_tokens, graphs=not args.no_graphs, lr=args.lr, seed=args.seed)
    print(json.dumps(tc.to_jsonable(metrics), indent=1))


if __name__ == "__main__":
    main()
