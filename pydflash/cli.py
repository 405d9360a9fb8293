"""The `pydflash` command.

  generate  speculative decoding of one prompt (text or token ids); the embedded default pair without --target
  bench     speculative vs autoregressive over a prompt set: acceptance, tokens/s, speedup, identical output
  info      library, ABI, backends, devices
  demo      the drafter alone on random context features (no target)

User errors (missing directories, bad checkpoints, out-of-range ids, no library, no GPU) print one line on stderr
and exit 2; anything else is a bug in pydflash and keeps its traceback.
"""

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from . import _ffi
from .checkpoint import CheckpointError
from .config import DrafterConfig, TargetConfig
from .devices import cuda_devices

_USER_ERRORS = (_ffi.DflashError, CheckpointError, ImportError, OSError, ValueError, TypeError)
# Statuses that mean "this backend cannot run here", after which --backend auto retries on host.
_BACKEND_UNAVAILABLE = ("DFLASH_STATUS_NOT_SUPPORTED", "DFLASH_STATUS_NO_DEVICE", "DFLASH_STATUS_CUDA_ERROR")
BENCH_PROMPTS = (
    "def fibonacci(n):",
    "The quick brown fox",
    "import numpy as np\n",
    "Once upon a time, in a small village,",
    "SELECT name, count(*) FROM users",
    "The capital of France is",
    "for (int i = 0; i < n; ++i) {",
    "Speculative decoding works by",
)


def _note(message):
    print(f"pydflash: {message}", file=sys.stderr)


# --------------------------------------------------------------------------------------------------------------
# models, backends, prompts
# --------------------------------------------------------------------------------------------------------------

def _model_dirs(args, need_draft=True):
    """(target_dir, draft_dir or None): the given ones, checked, or the embedded default pair."""
    if args.target is None and args.draft is None:
        from .default_model import ensure_default_model

        target_dir, draft_dir = ensure_default_model()
        return target_dir, draft_dir
    if args.target is None:
        raise ValueError("--draft needs --target (the drafter reads the target's hidden states)")
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if path is not None and not Path(path).is_dir():
            raise FileNotFoundError(f"{flag} {path}: no such directory")
    if args.draft is None and need_draft:
        raise ValueError("--target needs --draft (or --block-size 1 for plain autoregressive decoding)")
    return Path(args.target), None if args.draft is None else Path(args.draft)


def _backend_order(choice):
    """Backends to try, in order. auto: cuda first when the library has it and a device is visible."""
    if choice != "auto":
        return [choice]
    lib = _ffi.load()
    count = lib.ffi.new("int32_t *")
    if lib.lib.dflash_backend_compiled(lib.lib.DFLASH_BACKEND_CUDA) and \
            lib.lib.dflash_cuda_device_count(count) == 0 and count[0] > 0:
        return ["cuda", "host"]
    return ["host"]


def _on_first_working_backend(backends, run):
    """run(backend) on the first backend that can run it. A later backend is tried only when the library says
    the earlier one cannot run here (not built, no device, a CUDA failure), with a note on stderr."""
    for i, backend in enumerate(backends):
        try:
            return run(backend)
        except _ffi.DflashError as e:
            if i + 1 == len(backends) or e.status_name not in _BACKEND_UNAVAILABLE:
                raise
            _note(f"note: the {backend} backend cannot run here ({e}); using {backends[i + 1]}")
    raise AssertionError("unreachable: no backend given")


def _load(stack, target_dir, draft_dir, backend, *, max_seq_len, block_size):
    """(Target, Drafter or None) on `backend`, closed by `stack`."""
    from .drafter import Drafter
    from .target import Target

    target = stack.enter_context(Target.from_pretrained(target_dir, backend=backend, max_seq_len=max_seq_len,
                                                        max_verify_rows=max(block_size, 1)))
    drafter = None
    if draft_dir is not None and block_size > 1:
        drafter = stack.enter_context(Drafter.from_pretrained(draft_dir, target=target, max_seq_len=max_seq_len))
    return target, drafter


def _block_size(args, draft_dir):
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if draft_dir is None:
        return 1 if args.block_size is None else args.block_size
    trained = DrafterConfig.from_json(draft_dir).block_size
    if args.block_size is not None and args.block_size > trained:
        raise ValueError(f"--block-size {args.block_size} > the drafter's block_size {trained}")
    return trained if args.block_size is None else args.block_size


def _tokenizer(target_dir, config, required):
    """The target's tokenizer; None when there is none and none is required (token ids in, ids out)."""
    from .tokenizer import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(target_dir, config.vocab_size)
    except TokenizerError:
        if required:
            raise
        return None


def _parse_ids(text):
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def _stop_tokens(args, config):
    return [] if args.ignore_eos else list(config.eos_token_ids)


def _printable(text, stream):
    """Text safe for `stream`: on a terminal, control characters (a random model emits escape sequences too)
    become \\xNN escapes; characters the stream cannot encode become '?'."""
    if stream.isatty():
        text = "".join(c if c in "\n\t" or (c.isprintable() and c != "\x7f") else f"\\x{ord(c):02x}"
                       if ord(c) < 256 else c for c in text)
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return text.encode(encoding, errors="replace").decode(encoding)


# --------------------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------------------

def _generate(args):
    from .generate import check_positions, checked_prompt, generate
    from .sampling import SamplingParams

    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give a PROMPT (text) or --prompt-ids, exactly one")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    SamplingParams(args.temperature, args.top_p, args.top_k, args.seed or 0, args.draft_mode)  # refuse early
    target_dir, draft_dir = _model_dirs(args, need_draft=args.block_size != 1)
    block_size = _block_size(args, draft_dir)
    config = TargetConfig.from_json(target_dir)
    tokenizer = _tokenizer(target_dir, config, required=args.prompt is not None)
    prompt_ids = tokenizer.encode(args.prompt) if args.prompt is not None else _parse_ids(args.prompt_ids)
    prompt_ids = checked_prompt(prompt_ids, config.vocab_size)
    check_positions(config, len(prompt_ids), args.max_new_tokens)
    max_length = len(prompt_ids) + args.max_new_tokens

    def run(backend):
        with ExitStack() as stack:
            target, drafter = _load(stack, target_dir, draft_dir, backend, max_seq_len=max_length,
                                    block_size=block_size)
            result = generate(target, drafter, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed, block_size=block_size,
                              stop_token_ids=_stop_tokens(args, config), draft_mode=args.draft_mode)
            return result, backend

    result, backend = _on_first_working_backend(_backend_order(args.backend), run)
    text = tokenizer.decode(result.output_ids) if tokenizer is not None else None
    if args.json:
        report = {**result.to_dict(), "backend": backend, "target": str(target_dir),
                  "draft": None if draft_dir is None else str(draft_dir)}
        if text is not None:
            report["text"] = text
        print(json.dumps(report))
        return 0
    shown = text if text is not None else ",".join(map(str, result.output_ids))
    print(_printable(shown, sys.stdout))
    _note(f"{len(result.output_ids)} tokens in {result.time_to_first_token + result.decode_time:.3f} s "
          f"({result.tokens_per_second:.1f} tok/s, first token {result.time_to_first_token * 1e3:.1f} ms), "
          f"{result.num_steps} steps, mean acceptance {result.mean_acceptance_length:.2f} "
          f"(block {result.block_size}, {backend})")
    return 0


# --------------------------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------------------------

class _Progress:
    """A plain-text progress bar on stderr, redrawn in place on a terminal, one line per update otherwise."""

    def __init__(self, total, label, width=30):
        self.total, self.label, self.width, self.done = total, label, width, 0
        self.tty = sys.stderr.isatty()

    def step(self, what=""):
        self.done += 1
        filled = self.width * self.done // max(self.total, 1)
        line = f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {what}"
        print(("\r" + line.ljust(self.width + 60)) if self.tty else line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)
        if self.tty and self.done == self.total:
            print(file=sys.stderr)


def acceptance_by_position(acceptance_lengths, block_size):
    """[rate for k = 1 .. block_size-1]: the fraction of steps that accepted at least k drafts."""
    steps = len(acceptance_lengths)
    return [sum(1 for a in acceptance_lengths if a - 1 >= k) / steps if steps else 0.0
            for k in range(1, block_size)]


def _bench_prompts(args):
    if args.prompts is None:
        if args.target is None:  # the embedded default: its own held-out prompts when it is the trained pair
            from .default_model import default_prompts

            shipped = default_prompts()
            if shipped:
                return shipped
        return list(BENCH_PROMPTS)
    path = Path(args.prompts)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file")
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompt (one per line)")
    return prompts


def _bench(args):
    from .generate import check_positions, checked_prompt, generate

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.plot:
        try:
            import matplotlib
        except ImportError:
            raise ImportError("--plot needs matplotlib (pip install matplotlib)") from None
        matplotlib.use("Agg")  # files only; never a display
    target_dir, draft_dir = _model_dirs(args)
    block_size = _block_size(args, draft_dir)
    if block_size < 2:
        raise ValueError("bench compares drafting with plain decoding: --block-size must be >= 2")
    config = TargetConfig.from_json(target_dir)
    tokenizer = _tokenizer(target_dir, config, required=True)
    prompts = _bench_prompts(args)
    encoded = [checked_prompt(tokenizer.encode(p), config.vocab_size) for p in prompts]
    for ids in encoded:
        check_positions(config, len(ids), args.max_new_tokens)
    max_length = max(len(ids) for ids in encoded) + args.max_new_tokens
    stop = _stop_tokens(args, config)

    with ExitStack() as stack:
        def load_and_warm(backend):
            inner = ExitStack()
            try:
                target, drafter = _load(inner, target_dir, draft_dir, backend, max_seq_len=max_length,
                                        block_size=block_size)
                # One short run each way first, so one-time costs (first allocations, graph captures) stay out of
                # the timings.
                for d in (drafter, None):
                    generate(target, d, encoded[0], min(8, args.max_new_tokens), block_size=block_size if d else 1)
            except BaseException:
                inner.close()
                raise
            stack.enter_context(inner)
            return target, drafter, backend

        target, drafter, backend = _on_first_working_backend(_backend_order(args.backend), load_and_warm)
        progress = _Progress(len(encoded), f"bench ({backend}, block {block_size})")
        rows = []
        for prompt, ids in zip(prompts, encoded):
            spec = generate(target, drafter, ids, args.max_new_tokens, block_size=block_size, stop_token_ids=stop)
            ar = generate(target, None, ids, args.max_new_tokens, stop_token_ids=stop)
            rows.append({"prompt": prompt, "prompt_tokens": len(ids), "spec": spec, "ar": ar,
                         "same_output": spec.output_ids == ar.output_ids})
            progress.step(f"{spec.mean_acceptance_length:.2f} accepted/step")

    summary = _bench_summary(rows, block_size)
    report = {"backend": backend, "block_size": block_size, "max_new_tokens": args.max_new_tokens,
              "target": str(target_dir), "draft": str(draft_dir), **summary,
              "prompts": [{"prompt": r["prompt"], "prompt_tokens": r["prompt_tokens"],
                           "same_output": r["same_output"], "spec": _run_summary(r["spec"]),
                           "ar": _run_summary(r["ar"])} for r in rows]}
    if args.plot:
        _plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def _run_summary(result):
    return {"output_ids": result.output_ids, "new_tokens": len(result.output_ids), "steps": result.num_steps,
            "acceptance_lengths": result.acceptance_lengths,
            "mean_acceptance_length": result.mean_acceptance_length,
            "tokens_per_second": result.tokens_per_second, "time_to_first_token": result.time_to_first_token,
            "decode_time": result.decode_time}


def _bench_summary(rows, block_size):
    """Pooled over prompts: tokens and seconds summed before dividing, so long outputs weigh as they cost."""
    spec_lengths = [a for r in rows for a in r["spec"].acceptance_lengths]

    def rate(key):
        tokens = sum(len(r[key].output_ids) for r in rows)
        seconds = sum(r[key].time_to_first_token + r[key].decode_time for r in rows)
        return tokens / seconds if seconds > 0 else 0.0

    spec_rate, ar_rate = rate("spec"), rate("ar")
    return {"mean_acceptance_length": sum(spec_lengths) / len(spec_lengths) if spec_lengths else 0.0,
            "acceptance_rate_by_position": acceptance_by_position(spec_lengths, block_size),
            "spec_tokens_per_second": spec_rate, "ar_tokens_per_second": ar_rate,
            "speedup": spec_rate / ar_rate if ar_rate > 0 else 0.0,
            "same_output": sum(r["same_output"] for r in rows), "num_prompts": len(rows)}


def _print_table(report):
    header = f"{'#':>3}  {'prompt':<28} {'tokens':>6} {'steps':>5} {'accept':>6} {'spec tok/s':>10} " \
             f"{'AR tok/s':>9} {'speedup':>7}  same"
    print(header)
    print("-" * len(header))
    for i, p in enumerate(report["prompts"], 1):
        spec, ar = p["spec"], p["ar"]
        speedup = spec["tokens_per_second"] / ar["tokens_per_second"] if ar["tokens_per_second"] > 0 else 0.0
        label = p["prompt"].replace("\n", "\\n")
        label = label if len(label) <= 28 else label[:25] + "..."
        print(f"{i:>3}  {label:<28} {spec['new_tokens']:>6} {spec['steps']:>5} {spec['mean_acceptance_length']:>6.2f} "
              f"{spec['tokens_per_second']:>10.1f} {ar['tokens_per_second']:>9.1f} {speedup:>6.2f}x  "
              f"{'yes' if p['same_output'] else 'NO'}")
    print("-" * len(header))
    tokens = sum(p["spec"]["new_tokens"] for p in report["prompts"])
    steps = sum(p["spec"]["steps"] for p in report["prompts"])
    print(f"{'all':>3}  {'':<28} {tokens:>6} {steps:>5} {report['mean_acceptance_length']:>6.2f} "
          f"{report['spec_tokens_per_second']:>10.1f} {report['ar_tokens_per_second']:>9.1f} "
          f"{report['speedup']:>6.2f}x  {report['same_output']}/{report['num_prompts']}")
    rates = "  ".join(f"{k}:{r:.2f}" for k, r in enumerate(report["acceptance_rate_by_position"], 1))
    print(f"acceptance rate by draft position: {rates}")
    print(f"backend {report['backend']}, block size {report['block_size']}, "
          f"max {report['max_new_tokens']} new tokens per prompt")


def _plot(report, path):
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rates = report["acceptance_rate_by_position"]
    left.bar(range(1, len(rates) + 1), rates, color="tab:blue")
    left.set(xlabel="draft position k", ylabel="fraction of steps accepting >= k drafts", ylim=(0, 1),
             title=f"acceptance (mean length {report['mean_acceptance_length']:.2f})")
    right.bar(["speculative", "autoregressive"], [report["spec_tokens_per_second"], report["ar_tokens_per_second"]],
              color=["tab:green", "tab:gray"])
    right.set(ylabel="tokens / s", title=f"throughput ({report['speedup']:.2f}x, {report['backend']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------------
# info, demo
# --------------------------------------------------------------------------------------------------------------

def _info(args):
    lib = _ffi.load()
    ffi, c = lib.ffi, lib.lib
    compiled = [name for name, code in (("host", c.DFLASH_BACKEND_HOST), ("cuda", c.DFLASH_BACKEND_CUDA))
                if c.dflash_backend_compiled(code)]
    count = ffi.new("int32_t *")
    status = c.dflash_cuda_device_count(count)
    seen = str(count[0]) if status == 0 else ffi.string(c.dflash_status_string(status)).decode()
    print(f"library:   {lib.path}")
    print(f"header:    {lib.header}")
    print(f"abi:       {c.dflash_abi_version()}")
    print(f"build:     {ffi.string(c.dflash_build_info()).decode()}")
    print(f"backends:  {', '.join(compiled)}")
    print(f"cuda devices seen by libdflash: {seen}")
    devices = cuda_devices()
    for i, d in enumerate(devices):
        major, minor = d["compute_capability"]
        print(f"  cuda:{i}  {d['name']}  {d['total_memory'] / 2**30:.1f} GiB  sm_{major}{minor}")
    if not devices:
        print("  (cuda-python sees no CUDA device)")
    return 0


def _demo(args):
    from .default_model import ensure_default_model
    from .drafter import Drafter

    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    target_dir, draft_dir = ensure_default_model()
    rng = np.random.default_rng(args.seed)
    prompt_len = 12
    report = {"backend": args.backend, "checkpoint": str(draft_dir.parent), "steps": []}
    with Drafter.from_pretrained(draft_dir, target_dir, backend=args.backend, max_seq_len=4096) as drafter:
        width, vocab, block = drafter.feature_width, drafter.config.vocab_size, drafter.block_size
        budget = prompt_len + (args.steps + 1) * block
        with drafter.new_sequence(budget) as seq:
            # Random stand-ins for the target: its captured hidden states and its tokens.
            seq.append_context(rng.standard_normal((prompt_len, width), dtype=np.float32))
            position, token = prompt_len, int(rng.integers(vocab))
            for step in range(args.steps):
                start = time.perf_counter()
                drafts = seq.propose(token, position, block - 1)
                elapsed_ms = (time.perf_counter() - start) * 1e3
                accepted = int(rng.integers(len(drafts) + 1))
                seq.after_verify(accepted)
                # Committed: the anchor and the accepted drafts; their hidden states become context rows.
                seq.append_context(rng.standard_normal((accepted + 1, width), dtype=np.float32))
                report["steps"].append({"step": step, "anchor": token, "position": position, "drafts": drafts,
                                        "accepted": accepted, "propose_ms": round(elapsed_ms, 3)})
                if not args.json:
                    print(f"step {step:3d}  anchor {token:4d} @ {position:4d}  accepted {accepted}/{len(drafts)}  "
                          f"{elapsed_ms:7.3f} ms  drafts {drafts}")
                position, token = position + accepted + 1, int(rng.integers(vocab))  # the bonus token
            report["sequence"] = seq.info()
            report["pool"] = drafter.pool_stats()
        report["pool_after_free"] = drafter.pool_stats()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"sequence:  {report['sequence']}")
        print(f"pool:      {report['pool']}")
        print(f"after free: {report['pool_after_free']}")
    return 0


# --------------------------------------------------------------------------------------------------------------
# argument parsing
# --------------------------------------------------------------------------------------------------------------

def _add_model_arguments(p):
    p.add_argument("--target", metavar="DIR", help="target checkpoint (HF layout); default: the embedded pair")
    p.add_argument("--draft", metavar="DIR", help="DFlash drafter checkpoint for --target")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--block-size", type=int, default=None, metavar="B",
                   help="tokens per verify (anchor + drafts); default the drafter's; 1 = autoregressive")
    p.add_argument("--backend", choices=["auto", "host", "cuda"], default="auto",
                   help="auto: cuda when a GPU and the library's cuda backend can run, else host")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the target's EOS token(s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def build_parser():
    parser = argparse.ArgumentParser(prog="pydflash", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with speculative decoding")
    gen.add_argument("prompt", nargs="?", metavar="PROMPT", help="prompt text (needs a tokenizer)")
    gen.add_argument("--prompt-ids", metavar="IDS", help="prompt as comma-separated token ids, e.g. 1,2,3")
    _add_model_arguments(gen)
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P")
    gen.add_argument("--top-k", type=int, default=0, metavar="K")
    gen.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (default: random)")
    gen.add_argument("--draft-mode", choices=["greedy", "sample"], default="greedy",
                     help="at T > 0: greedy drafts with a one-hot proposal (default) or drafts sampled from the "
                          "drafter's own distribution")

    bench = sub.add_parser("bench", help="speculative vs autoregressive decoding over a prompt set")
    bench.add_argument("--prompts", metavar="FILE",
                       help="one prompt per line (default: the trained default pair's held-out prompts, "
                            "else 8 built-in prompts)")
    _add_model_arguments(bench)
    bench.add_argument("--plot", metavar="PNG", help="also draw acceptance per position and tokens/s (matplotlib)")

    sub.add_parser("info", help="library path, ABI, build, compiled backends, CUDA devices")
    demo = sub.add_parser("demo", help="run the drafter alone on random context features")
    demo.add_argument("--backend", choices=["host", "cuda"], default="host")
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print one JSON report instead of text")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    commands = {"generate": _generate, "bench": _bench, "info": _info, "demo": _demo}
    try:
        return commands[args.command](args)
    except BrokenPipeError:
        # The reader left (`pydflash generate ... | head`): nothing to report. Point stdout at /dev/null so the
        # interpreter's final flush does not fail again at exit.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except _USER_ERRORS as e:
        print(f"pydflash: error: {e}".replace("\n", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pydflash: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
