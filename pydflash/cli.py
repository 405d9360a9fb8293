"""The `pydflash` command: `info` (library, backends, devices) and `demo` (a drafter on a random checkpoint)."""

import argparse
import json
import sys
import time

import numpy as np

from . import _ffi
from .checkpoint import CheckpointError
from .devices import cuda_devices

# Failures a user can cause (no library, bad checkpoint, no GPU): one line, exit 2. Anything else is a bug in
# pydflash and keeps its traceback.
_USER_ERRORS = (_ffi.DflashError, CheckpointError, ImportError, OSError, ValueError, TypeError)


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
    from ._demo_checkpoint import ensure_demo_checkpoint
    from .drafter import Drafter

    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    draft_dir, target_dir = ensure_demo_checkpoint()
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="pydflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="library path, ABI, build, compiled backends, CUDA devices")
    demo = sub.add_parser("demo", help="run a drafter built from a tiny random checkpoint")
    demo.add_argument("--backend", choices=["host", "cuda"], default="host")
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print one JSON report instead of text")
    args = parser.parse_args(argv)
    try:
        return {"info": _info, "demo": _demo}[args.command](args)
    except _USER_ERRORS as e:
        print(f"pydflash: error: {e}".replace("\n", " "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
