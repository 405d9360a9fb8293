#!/usr/bin/env python3
"""Build the corpus, train the default target then its DFlash drafter, measure held-out acceptance, pack the pair.

    OUT=dir python3 tools/train_default.py [--budget-s 420] [--tiny]      (tools/train_default.sh wraps this)

One process, one wall-clock budget (default 420 s on one H200, corpus included): the corpus takes what it takes,
then the time left minus a reserve for evaluation and packing is split between the target (--target-share) and
the drafter (rollouts + training). Every stage is guarded: a failure is logged with its traceback and the stages
after it still run where they can, so train_log.json and whatever checkpoints exist are always written.

Writes under $OUT (the device tool returns at most 8 files of at most 16 MiB, so the pair travels as a split tar):
  default_pair.tar.partN   the tar of {target/, draft/, prompts.json} cut into 15 MiB pieces;
                           `cat default_pair.tar.part* | tar -x -C pydflash/models/default` unpacks it
  train_log.json           corpus, seeds, steps, losses, acceptance, checks, timings, errors
and the stdout of train_default.sh in train.log. The unpacked pair and the corpus stay in --work.
"""

import argparse
import hashlib
import inspect
import io
import json
import os
import shutil
import sys
import tarfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_common as tc  # noqa: E402
import train_drafter  # noqa: E402
import train_target  # noqa: E402

PART_BYTES = 15 * 2**20
NUM_SHIPPED_PROMPTS = 16


class Run:
    """The log: written to OUT/train_log.json after every stage."""

    def __init__(self, out_dir, budget_s):
        self.out_dir, self.budget_s = out_dir, budget_s
        self.log = {"budget_s": budget_s, "environment": tc.environment(), "stages": {}, "errors": []}

    def elapsed(self):
        return time.time() - tc._T0

    def left(self):
        return self.budget_s - self.elapsed()

    def stage(self, name, fn, *args, **kwargs):
        tc.log(f"=== {name} ({self.left():.0f} s of the budget left)")
        t0 = time.time()
        state = kwargs.setdefault("state", {}) if "state" in inspect.signature(fn).parameters else None
        try:
            result = fn(*args, **kwargs)
            self.log["stages"][name] = {"ok": True, "seconds": round(time.time() - t0, 1), "result": result}
            return result
        except Exception as e:  # keep going: write what there is
            tb = traceback.format_exc()
            tc.log(f"{name} FAILED: {type(e).__name__}: {e}\n{tb}")
            self.log["errors"].append({"stage": name, "error": f"{type(e).__name__}: {e}", "traceback": tb})
            self.log["stages"][name] = {"ok": False, "seconds": round(time.time() - t0, 1), "partial": state}
            return None
        finally:
            self.write()

    def write(self):
        self.log["elapsed_s"] = round(self.elapsed(), 1)
        path = os.path.join(self.out_dir, "train_log.json")
        with open(path + ".tmp", "w") as f:
            json.dump(tc.to_jsonable(self.log), f, indent=1)
        os.replace(path + ".tmp", path)


def _prompt_file_ranges(corpus_dir, prompts):
    """(offset, length) in the held-out stream of the files the evaluation prompts come from."""
    _, _, meta = tc.load_corpus(corpus_dir)
    files = {p["file"] for p in prompts}
    return [(f["offset"], f["length"]) for f in meta["heldout_files"] if f["key"] in files]


def heldout_walk_prompts(corpus_dir, eval_prompts, count, seed):
    """Up to `count` prompts (bytes) for the drafter's held-out measure and checkpoint choice, drawn by the rules of
    the evaluation prompts (train_common.extract_prompts: whole code lines of 200..400 bytes ending with a
    newline) from the held-out files the evaluation prompts do not come from, several per file (other seeds), no
    per-package limit."""
    _, heldout, meta = tc.load_corpus(corpus_dir)
    used = {p["file"] for p in eval_prompts}
    files = [f for f in meta["heldout_files"] if f["key"] not in used]
    out, seen = [], set()
    for s in range(1, 33):
        for p in tc.extract_prompts(heldout, files, count, seed=1000 * (seed + 1) + s, per_package=10**9):
            if (p["file"], p["line"]) not in seen:
                seen.add((p["file"], p["line"]))
                out.append(p["text"].encode())
        if len(out) >= count:
            break
    tc.log(f"held-out measure prompts: {len(out[:count])} from {len(files)} held-out files (the evaluation "
           f"prompts' {len(used)} files left out)")
    return out[:count]


def make_prompts(corpus_dir, count, seed):
    _, heldout, meta = tc.load_corpus(corpus_dir)
    prompts = tc.extract_prompts(heldout, meta["heldout_files"], count, seed=seed)
    tc.log(f"prompts: {len(prompts)} from held-out files, {sum(len(p['text']) for p in prompts)} bytes")
    return prompts


def evaluate(target_dir, draft_dir, prompts, max_new_tokens, deadline, device, lossless_prompts=4):
    """Greedy speculative decoding with the shipped (bf16) weights computed in fp32: acceptance per prompt, pooled
    mean (tokens / steps, as `pydflash bench`), and spec == autoregressive on the first prompts."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    target = tc.load_target(target_dir).to(device).eval()
    drafter = tc.load_drafter(draft_dir, target.shape).to(device).eval()
    out = {"max_new_tokens": max_new_tokens, "block_size": drafter.shape.block_size, "prompts": []}
    for i, p in enumerate(prompts):
        if time.time() > deadline:
            tc.log(f"eval: deadline, {i} of {len(prompts)} prompts done")
            break
        ids = list(p["text"].encode())
        new, lengths = tc.speculative_generate(target, drafter, ids, max_new_tokens)
        row = {"file": p["file"], "new_tokens": len(new), "steps": len(lengths),
               "mean_acceptance": len(new) / max(1, len(lengths)), "acceptance_lengths": lengths}
        if i < lossless_prompts:
            row["same_as_autoregressive"] = new == tc.greedy_generate(target, ids, max_new_tokens)
        out["prompts"].append(row)
    rows = out["prompts"]
    tokens, steps = sum(r["new_tokens"] for r in rows), sum(r["steps"] for r in rows)
    hist = [0] * (out["block_size"] + 1)
    for r in rows:
        for n in r["acceptance_lengths"]:
            hist[n] += 1
    out.update({"num_prompts": len(rows), "tokens": tokens, "steps": steps,
                "mean_acceptance_length": tokens / max(1, steps),
                "mean_of_prompt_means": sum(r["mean_acceptance"] for r in rows) / max(1, len(rows)),
                "acceptance_histogram": hist,
                "lossless": [r["same_as_autoregressive"] for r in rows if "same_as_autoregressive" in r]})
    tc.log(f"eval (max {max_new_tokens} new): mean acceptance {out['mean_acceptance_length']:.3f} over "
           f"{len(rows)} prompts ({tokens} tokens / {steps} steps), spec == AR on {sum(out['lossless'])}/"
           f"{len(out['lossless'])}")
    return out


def check_references(target_dir, draft_dir, prompts, device, max_new_tokens=64):
    """transformers loads the target and agrees with ours; when dflash imports here (tools/train_default.sh
    installs it from build/whl when carried), DFlashDraftModel loads the drafter and dflash_generate gives the
    acceptance lengths of our torch loop on the first prompts (fp32)."""
    import transformers

    ids = torch.tensor([list(prompts[0]["text"].encode())], device=device)
    ours = tc.load_target(target_dir).to(device).eval()
    ref = transformers.Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        a, _ = ours(ids)
        b = ref(ids).logits
    result = {"transformers": transformers.__version__,
              "target_logits_rel_err_vs_transformers": float((a - b).norm() / b.norm())}
    try:
        from dflash import model as dfm
    except ImportError:
        result["dflash"] = "not importable here (checked by tests/test_default_model.py and --self-check)"
        return result
    ref_d = dfm.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).to(device).eval()
    drafter = tc.load_drafter(draft_dir, ours.shape).to(device).eval()
    same = []
    cuda_time = dfm._cuda_time
    if device.type != "cuda":  # return_stats times with torch.cuda.synchronize()
        dfm._cuda_time = time.perf_counter
    try:
        for p in prompts[:2]:
            prompt = list(p["text"].encode())
            new, lengths = tc.speculative_generate(ours, drafter, prompt, max_new_tokens)
            out = dfm.dflash_generate(ref_d, ref, torch.tensor([prompt], device=device), max_new_tokens,
                                      [tc.EOS_TOKEN_ID], return_stats=True)
            same.append(out.output_ids[0, len(prompt):].tolist() == new and list(out.acceptance_lengths) == lengths)
    finally:
        dfm._cuda_time = cuda_time
    result["dflash"] = f"dflash_generate == ours (tokens and acceptance lengths) on {sum(same)}/{len(same)} prompts"
    return result


def pack(pair_dir, out_dir, prompts):
    """Tar {target, draft, prompts.json} and split it into PART_BYTES pieces in out_dir; returns their names and
    sha256s (of each part and of the whole tar)."""
    with open(os.path.join(pair_dir, "prompts.json"), "w") as f:
        json.dump(prompts, f, indent=1, ensure_ascii=False)
        f.write("\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("target", "draft", "prompts.json"):
            path = os.path.join(pair_dir, name)
            if os.path.exists(path):
                tar.add(path, arcname=name, filter=_plain)
    data = buf.getvalue()
    for old in os.listdir(out_dir):
        if old.startswith("default_pair.tar.part"):
            os.remove(os.path.join(out_dir, old))
    parts = []
    for i in range(0, len(data), PART_BYTES):
        name = f"default_pair.tar.part{i // PART_BYTES}"
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data[i:i + PART_BYTES])
        parts.append({"name": name, "bytes": len(data[i:i + PART_BYTES]),
                      "sha256": hashlib.sha256(data[i:i + PART_BYTES]).hexdigest()})
    sizes = {}
    for sub in ("target", "draft"):
        path = os.path.join(pair_dir, sub, "model.safetensors")
        if os.path.exists(path):
            sizes[sub + "_safetensors_bytes"] = os.path.getsize(path)
    tc.log(f"packed {len(data) / 1e6:.1f} MB into {len(parts)} parts: {sizes}")
    return {"tar_bytes": len(data), "tar_sha256": hashlib.sha256(data).hexdigest(), "parts": parts, **sizes,
            "unpack": "cat default_pair.tar.part* | tar -x -C pydflash/models/default"}


def _shipped_prompts(prompts):
    chosen = prompts[:NUM_SHIPPED_PROMPTS]
    return {"version": 1, "source": "held-out corpus files (tools/train_default.py), whole lines of 200..400 bytes",
            "prompts": [p["text"] for p in chosen], "sources": [{"file": p["file"], "line": p["line"]} for p in chosen]}


def _plain(info):
    info.mode = 0o755 if info.isdir() else 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def tiny_settings():
    """A CPU-sized run for checking the pipeline end to end (minutes on 2 cores)."""
    return {
        "corpus": {"max_mb": 4.0, "max_heldout_mb": 1.0, "heldout_permille": 60},
        "target_shape": tc.TargetShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                       intermediate_size=128),
        "target": {"batch": 16, "seq_len": 256, "lr": 3e-3, "warmup": 20, "eval_every": 100,
                   "heldout_windows_count": 16},
        "drafter_shape": tc.DrafterShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                                         intermediate_size=128, block_size=8, target_layer_ids=[0, 1]),
        "drafter": {"rollout_batch": 64, "max_rollouts": 16384, "window_len": 400, "min_prompt_len": 64,
                    "cuts_per_window": 4, "gen_len": 48, "batch": 16, "anchors_per_seq": 8, "eval_every": 50,
                    "heldout_rollouts": 64, "walk_new_tokens": 32, "warmup": 20},
        "eval_prompts": 6, "eval_max_new": [32, 64],
    }


def full_settings():
    return {
        "corpus": {"max_mb": 500.0, "max_heldout_mb": 8.0, "heldout_permille": 15},
        "target_shape": tc.TargetShape(),
        "target": {},
        "drafter_shape": tc.DrafterShape(),
        "drafter": {},
        "eval_prompts": 2 * NUM_SHIPPED_PROMPTS, "eval_max_new": [64, 256],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "build/train_out")
    p.add_argument("--work", default=None, help="corpus and unpacked checkpoints (default: /tmp/pydflash_train)")
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--tiny", action="store_true", help="CPU-sized models and corpus, for checking the pipeline")
    p.add_argument("--target-share", type=float, default=0.42,
                   help="of the training time (budget - corpus - reserve), for the target; the drafter gets the rest")
    p.add_argument("--reserve-s", type=float, default=None, help="kept for evaluation and packing")
    p.add_argument("--target-steps", type=int, default=None, help="fix the steps (default: from a timing probe)")
    p.add_argument("--drafter-steps", type=int, default=None)
    p.add_argument("--corpus-mb", type=float, default=None)
    p.add_argument("--compile", action="store_true", help="torch.compile the target's training forward")
    p.add_argument("--no-graphs", action="store_true", help="eager rollout decoding steps (no CUDA graphs)")
    p.add_argument("--seed", type=int, default=0, help="target seed; the drafter uses seed + 1")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = p.parse_args(argv)

    settings = tiny_settings() if args.tiny else full_settings()
    if args.corpus_mb:
        settings["corpus"]["max_mb"] = args.corpus_mb
    os.makedirs(args.out, exist_ok=True)
    work = args.work or os.path.join("/tmp", "pydflash_train")
    corpus_dir, pair_dir = os.path.join(work, "corpus"), os.path.join(work, "pair")
    shutil.rmtree(pair_dir, ignore_errors=True)
    os.makedirs(pair_dir)
    target_dir, draft_dir = os.path.join(pair_dir, "target"), os.path.join(pair_dir, "draft")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    run = Run(args.out, args.budget_s)
    run.log.update({"args": vars(args), "settings": tc.to_jsonable(settings), "work": work,
                    "seeds": {"target": args.seed, "drafter": args.seed + 1, "prompts": args.seed,
                              "corpus": "deterministic (hash order)"}})
    tc.log(f"train_default: budget {args.budget_s:.0f} s, device {device}, out {args.out}, work {work}")
    reserve = args.reserve_s if args.reserve_s is not None else (40.0 if not args.tiny else 0.25 * args.budget_s)

    corpus = run.stage("corpus", tc.build_corpus, corpus_dir, workers=args.workers, **settings["corpus"])
    if corpus:
        tc.log(f"corpus: {corpus['train_files']} train files / {corpus['train_bytes'] / 1e6:.1f} MB, "
               f"{corpus['heldout_files']} held-out / {corpus['heldout_bytes'] / 1e6:.1f} MB "
               f"({corpus['duplicate_files']} duplicates, {corpus['rejected_files']} rejected) in "
               f"{corpus['seconds']} s")
    prompts = run.stage("prompts", make_prompts, corpus_dir, settings["eval_prompts"], args.seed) or []

    train_time = max(10.0, run.left() - reserve)
    target = run.stage("target", train_target.train, corpus_dir, target_dir, shape=settings["target_shape"],
                       budget_s=train_time * args.target_share, steps=args.target_steps, seed=args.seed,
                       device=device, compile_model=args.compile, **settings["target"])
    torch.cuda.empty_cache() if device.type == "cuda" else None
    if target:  # packed now too, so a run killed later still returns the target
        run.stage("pack_target", pack, pair_dir, args.out, _shipped_prompts(prompts))
    drafter = None
    if os.path.exists(os.path.join(target_dir, "model.safetensors")):
        walk_prompts = []
        try:  # without them the drafter measures on windows of the held-out stream
            walk_prompts = heldout_walk_prompts(corpus_dir, prompts, settings["drafter"].get("heldout_rollouts", 512),
                                                args.seed)
        except Exception as e:  # noqa: BLE001
            tc.log(f"held-out measure prompts FAILED: {type(e).__name__}: {e}")
            run.log["errors"].append({"stage": "heldout_walk_prompts", "error": f"{type(e).__name__}: {e}",
                                      "traceback": traceback.format_exc()})
        run.log["heldout_walk_prompts"] = len(walk_prompts)
        drafter = run.stage("drafter", train_drafter.train, target_dir, corpus_dir, draft_dir,
                            shape=settings["drafter_shape"], budget_s=max(10.0, run.left() - reserve),
                            steps=args.drafter_steps, seed=args.seed + 1, device=device,
                            heldout_prompts=walk_prompts, heldout_exclude=_prompt_file_ranges(corpus_dir, prompts),
                            graphs=not args.no_graphs, **settings["drafter"])
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if os.path.exists(os.path.join(draft_dir, "model.safetensors")) and prompts:
        evals, sizes = {}, sorted(settings["eval_max_new"])
        for k, max_new in enumerate(sizes):  # the longest last, over all prompts; the others on the shipped ones
            chosen = prompts if max_new == sizes[-1] else prompts[:NUM_SHIPPED_PROMPTS]
            deadline = time.time() + max(5.0, run.left() - 10.0) / (len(sizes) - k)
            evals[str(max_new)] = run.stage(f"eval_{max_new}", evaluate, target_dir, draft_dir, chosen, max_new,
                                            deadline, device)
        run.log["acceptance"] = {k: v and {"mean_acceptance_length": v["mean_acceptance_length"],
                                           "num_prompts": v["num_prompts"]} for k, v in evals.items()}
        run.stage("reference_checks", check_references, target_dir, draft_dir, prompts, device)
    run.log["summary"] = {
        "corpus_train_mb": corpus and corpus["train_bytes"] / 1e6,
        "corpus_heldout_mb": corpus and corpus["heldout_bytes"] / 1e6,
        "target_steps": target and target["steps"],
        "target_train_loss": target and target["final_train_loss"],
        "target_heldout_loss": target and target["final_heldout_loss_bf16"],
        "drafter_steps": drafter and drafter["steps"],
        "drafter_rollouts": drafter and drafter["rollouts"],
        "drafter_rollout_tok_per_s": drafter and drafter["train_rollouts"]["speed"]["generated_tok_per_s"],
        "drafter_best_step": drafter and drafter["best_step"],
        "drafter_heldout_block_tau": drafter and drafter["heldout_block_tau_bf16"],
        "drafter_heldout_walk_acceptance": drafter and drafter["heldout_walk_acceptance_bf16"],
        "acceptance": run.log.get("acceptance"),
    }
    run.stage("pack", pack, pair_dir, args.out, _shipped_prompts(prompts))
    tc.log(f"summary: {json.dumps(tc.to_jsonable(run.log['summary']))}")
    tc.log(f"done in {run.elapsed():.0f} s; errors: {len(run.log['errors'])}")
    run.write()
    return 1 if run.log["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
