#!/usr/bin/env python3
"""Train the DFlash drafter of the embedded default pair against a frozen target (torch; tools only).

    python tools/train_drafter.py --target DIR --corpus DIR --out DIR [--budget-s 120 | --steps N]
    python tools/train_drafter.py --self-check [--target DIR --draft DIR --prompts FILE]   # needs transformers+dflash

The DFlash recipe, with labels that are exactly what greedy verification accepts:

1. Greedy rollouts. Prompts are windows of the train stream ending at a line end (lengths cycling through
   --prompt-lens); the frozen target continues each greedily for --gen-len tokens (batched, KV-cached, fp32
   logits). Every token of a continuation is the target's own greedy choice given everything before it, which is
   exactly the context the drafter sees at inference (prompt + the target's greedy output).
2. Blocks. Per sequence, --anchors random anchor positions a in the continuation (a + B - 1 inside it). Block
   input = [token at a, mask x (B-1)] at positions a..a+B-1; label of block row i (1..B-1) = token at a+i, i.e.
   what the target greedily generates i steps after the anchor.
3. Context. The target's hidden states after layers target_layer_ids (HF hidden_states[id + 1], concatenated) of
   the whole sequence, through the drafter's fc + hidden_norm; block j attends to context rows p < a_j (the rows
   dflash_generate has committed when it drafts from anchor a_j: the anchor's own row comes from the verify of
   that block) and to its own B rows, non-causally (train_common.DrafterModel / block_mask).
4. Loss. Cross-entropy of the target's lm_head over the drafter's final normed states (target embed_tokens and
   lm_head frozen, as the checkpoint borrows them), row i weighted by exp(-(i-1)/gamma).

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


def _autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def sample_prompts(stream, newlines, count, length, rng):
    """[count, length] uint8 windows of `stream`, each ending right after a newline where one follows."""
    ends = rng.integers(length, len(stream) - 1, size=count)
    if len(newlines):
        pos = np.searchsorted(newlines, ends - 1)  # the first newline at or after ends - 1
        snapped = newlines[np.minimum(pos, len(newlines) - 1)] + 1
        ends = np.where((pos < len(newlines)) & (snapped >= length), snapped, ends)
    return np.stack([stream[e - length:e] for e in ends])


@torch.no_grad()
def greedy_rollouts(target, prompts, gen_len, batch, device):
    """prompts [n, Lp] int64 (device) -> [n, Lp + gen_len]: each prompt and its greedy continuation."""
    outs = []
    n, lp = prompts.shape
    for i in range(0, n, batch):
        p = prompts[i:i + batch]
        cache = tc.KVCache(target.shape, p.shape[0], lp + gen_len, device,
                           torch.bfloat16 if device.type == "cuda" else torch.float32)
        with _autocast(device):
            logits, _ = target(p, cache=cache, fp32_logits=True)
            token = logits[:, -1].argmax(-1)
            seq = [p, token[:, None]]
            for j in range(gen_len - 1):
                logits, _ = target(token[:, None], cache=cache, start=lp + j, fp32_logits=True)
                token = logits[:, -1].argmax(-1)
                seq.append(token[:, None])
        outs.append(torch.cat(seq, dim=1))
    return torch.cat(outs)


def make_rollout_groups(target, stream_np, *, prompt_lens, gen_len, batch, seed, device, deadline, max_rollouts,
                        label):
    """Rollouts in groups of one prompt length each, a batch at a time, until the deadline or max_rollouts.
    Returns [(prompt_len, tensor [k, prompt_len + gen_len])]."""
    rng = np.random.default_rng(seed)
    newlines = np.flatnonzero(stream_np == 10)
    groups, made, i = {}, 0, 0
    t0 = time.time()
    while made < max_rollouts and (i == 0 or time.time() < deadline):
        lp = prompt_lens[i % len(prompt_lens)]
        k = min(batch, max_rollouts - made)
        prompts = sample_prompts(stream_np, newlines, k, lp, rng)
        ids = tc.bytes_to_ids(torch.from_numpy(prompts).to(device))
        groups.setdefault(lp, []).append(greedy_rollouts(target, ids, gen_len, batch, device))
        made += k
        i += 1
        if i == 1 or i % 8 == 0:
            tc.log(f"{label} rollouts: {made} ({made * gen_len / (time.time() - t0) / 1e3:.0f}k tok/s)")
    return [(lp, torch.cat(parts)) for lp, parts in sorted(groups.items())]


def block_batch(seqs, prompt_len, anchors_per_seq, block_size, generator):
    """Random anchors [b, N] in the continuation (positions prompt_len .. T-B), sorted per row."""
    b, T = seqs.shape
    span = T - block_size - prompt_len + 1
    n = min(anchors_per_seq, span)
    scores = torch.rand(b, span, generator=generator, device="cpu").to(seqs.device)
    return scores.topk(n, dim=1).indices.sort(dim=1).values + prompt_len


def drafter_loss(target, drafter, seqs, anchors, gamma, device):
    """(weighted loss, correct [b, N, B-1] bool) for the blocks at `anchors` of `seqs`."""
    B = drafter.shape.block_size
    b, N = anchors.shape
    T = seqs.shape[1]
    with torch.no_grad(), _autocast(device):
        _, features = target(seqs, capture=tuple(drafter.shape.target_layer_ids), logits=False)
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


@torch.no_grad()
def evaluate_blocks(target, drafter, groups, anchors_per_seq, gamma, device, seed=1234, batch=64):
    g = torch.Generator().manual_seed(seed)
    losses, corrects = [], []
    for lp, seqs in groups:
        for i in range(0, seqs.shape[0], batch):
            s = seqs[i:i + batch]
            anchors = block_batch(s, lp, anchors_per_seq, drafter.shape.block_size, g)
            loss, correct = drafter_loss(target, drafter, s, anchors, gamma, device)
            losses.append(float(loss) * s.shape[0])
            corrects.append(correct.reshape(-1, correct.shape[-1]))
    per_pos, tau = acceptance_stats(torch.cat(corrects))
    return sum(losses) / sum(s.shape[0] for _, s in groups), per_pos, tau


def train(target_dir, corpus_dir, out_dir, *, shape=None, budget_s=120.0, steps=None, rollout_fraction=0.3,
          max_rollouts=200_000, rollout_batch=1024, prompt_lens=(128, 192, 256, 320, 384), gen_len=256,
          batch=128, anchors_per_seq=32, lr=2e-3, warmup=50, weight_decay=0.01, gamma=None, seed=1,
          eval_every=200, heldout_rollouts=256, device=None, state=None):
    state = {} if state is None else state
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = shape or tc.DrafterShape()
    B = shape.block_size
    gamma = gamma or {16: 7.0, 10: 5.0, 8: 4.0}.get(B, B / 2)
    t_start = time.time()
    torch.manual_seed(seed)
    target = tc.load_target(target_dir).to(device).eval().requires_grad_(False)
    tshape = target.shape
    if max(shape.target_layer_ids) >= tshape.num_layers:
        raise ValueError(f"target_layer_ids {shape.target_layer_ids} beyond the target's {tshape.num_layers} layers")
    train_bytes, heldout_bytes, _ = tc.load_corpus(corpus_dir)
    state.update({"shape": tc.to_jsonable(shape), "gamma": gamma, "seed": seed, "batch": batch,
                  "anchors_per_seq": anchors_per_seq, "lr": lr, "gen_len": gen_len,
                  "prompt_lens": list(prompt_lens)})

    deadline = t_start + budget_s * rollout_fraction
    held = make_rollout_groups(target, heldout_bytes, prompt_lens=prompt_lens, gen_len=gen_len,
                               batch=max(1, heldout_rollouts // len(prompt_lens)), seed=seed + 1000, device=device,
                               deadline=float("inf"), max_rollouts=heldout_rollouts, label="held-out")
    groups = make_rollout_groups(target, train_bytes, prompt_lens=prompt_lens, gen_len=gen_len, batch=rollout_batch,
                                 seed=seed, device=device, deadline=deadline, max_rollouts=max_rollouts, label="train")
    n_rollouts = sum(s.shape[0] for _, s in groups)
    state.update({"rollouts": n_rollouts, "heldout_rollouts": sum(s.shape[0] for _, s in held),
                  "rollout_seconds": round(time.time() - t_start, 1)})
    tc.log(f"drafter: {n_rollouts} train rollouts x {gen_len} tokens, {state['heldout_rollouts']} held-out, "
           f"{state['rollout_seconds']} s")

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

    weights = np.array([s.shape[0] for _, s in groups], dtype=np.float64)
    weights /= weights.sum()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    t_train = time.time()
    budget_left = budget_s - (t_train - t_start)
    total, probe_from, probe_t = steps, 5, None
    auto = steps is None  # steps from timing: re-estimated at every evaluation
    history = []
    loss_sum, loss_count, correct_acc = torch.zeros((), device=device), 0, []
    step = 0
    while total is None or step < total:
        warm = warmup if total is None else min(warmup, max(1, total // 10))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total or 10**9, lr, warm)
        lp, seqs = groups[int(rng.choice(len(groups), p=weights))]
        idx = torch.from_numpy(rng.integers(0, seqs.shape[0], size=batch)).to(device)
        s = seqs[idx]
        anchors = block_batch(s, lp, anchors_per_seq, B, gen)
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
            torch.cuda.synchronize() if device.type == "cuda" else None
            probe_t = time.time()
        if total is None and step == probe_from + 10:
            torch.cuda.synchronize() if device.type == "cuda" else None
            per_step = (time.time() - probe_t) / 10
            left = budget_left - (time.time() - t_train)
            total = max(step + 1, step + int(left / per_step))
            tc.log(f"drafter: {per_step * 1e3:.1f} ms/step -> {total} steps")
            state["ms_per_step"] = per_step * 1e3
        if auto and total is not None and step % eval_every == 0 and step < total:
            torch.cuda.synchronize() if device.type == "cuda" else None
            per_step = (time.time() - probe_t) / (step - probe_from)
            estimate = max(step + 1, step + int((budget_left - (time.time() - t_train)) / per_step))
            if abs(estimate - total) > 0.05 * total:
                tc.log(f"drafter: {per_step * 1e3:.1f} ms/step so far -> {estimate} steps instead of {total}")
                total = estimate
        if step % eval_every == 0 or step == total:
            running = float(loss_sum) / loss_count
            _, train_tau = acceptance_stats(torch.cat(correct_acc))
            loss_sum, loss_count, correct_acc = torch.zeros((), device=device), 0, []
            h_loss, h_pos, h_tau = evaluate_blocks(target, drafter, held, anchors_per_seq, gamma, device)
            history.append({"step": step, "train_loss": running, "train_block_tau": train_tau,
                            "heldout_loss": h_loss, "heldout_block_tau": h_tau,
                            "seconds": round(time.time() - t_start, 1)})
            state["history"] = history
            tc.log(f"drafter step {step}/{total}: train {running:.4f} (tau {train_tau:.2f}) held-out {h_loss:.4f} "
                   f"(tau {h_tau:.2f}, acc@1 {h_pos[0]:.3f} acc@{B - 1} {h_pos[-1]:.3f})")
        if time.time() - t_start > budget_s * 1.15:
            tc.log(f"drafter: over budget, stopping at step {step}")
            break
    state["steps"] = step
    drafter = tc.bf16_rounded(drafter)
    h_loss, h_pos, h_tau = evaluate_blocks(target, drafter, held, anchors_per_seq, gamma, device)
    tc.save_checkpoint(drafter, shape.hf_config(tshape), out_dir)
    metrics = {**state, "final_train_loss": history[-1]["train_loss"] if history else None,
               "final_heldout_loss_bf16": h_loss, "heldout_block_tau_bf16": h_tau,
               "heldout_block_accuracy_by_position": h_pos, "seconds": round(time.time() - t_start, 1),
               "out": out_dir}
    tc.log(f"drafter: done, {step} steps, held-out block loss {h_loss:.4f}, block tau {h_tau:.2f} (bf16 weights), "
           f"saved {out_dir}")
    return metrics


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
    p.add_argument("--gen-len", type=int, default=256)
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
    if not (args.target and args.corpus and args.out):
        p.error("--target, --corpus and --out are required (or --self-check)")
    shape = tc.DrafterShape(num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                            head_dim=args.head_dim, intermediate_size=args.intermediate, block_size=args.block_size,
                            target_layer_ids=[int(x) for x in args.target_layer_ids.split(",")])
    metrics = train(args.target, args.corpus, args.out, shape=shape, budget_s=args.budget_s, steps=args.steps,
                    batch=args.batch, anchors_per_seq=args.anchors, gen_len=args.gen_len, lr=args.lr, seed=args.seed)
    print(json.dumps(tc.to_jsonable(metrics), indent=1))


if __name__ == "__main__":
    main()
