"""Whole paths on the cuda backend against the host backend (run on the device machine).

- Drafter propose: hidden states within 2e-2 relative of the host's; drafts identical wherever
  the host's top-2 logit margin (recomputed in fp32 from the host hidden states) exceeds the
  bf16 error bound.
- Target: greedy decoding on cuda equals the host's token for token until the first position
  where the host's own top-2 margin is within the bf16 error (then the paths may part).
- Lossless on one backend: cuda speculative output == cuda autoregressive output, exactly.
- CUDA graphs: replayed verify / decode forwards equal the same kernels launched eagerly, bit for bit
  (40 speculative steps per run; DFLASH_TEST_GRAPH_STEPS).
- Lifecycle: 10 000 (DFLASH_TEST_LIFECYCLE_CYCLES) alloc/propose/after_verify/free cycles leave device
  memory where it started.
- Out of memory at finalize is a clean error that leaves nothing behind.
"""
import os

import numpy as np
import pytest

import pydflash
from pydflash import Drafter, DflashError, Target
from pydflash.checkpoint import load_tensors

pytestmark = pytest.mark.gpu

BF16_MARGIN = 0.05  # relative to the row's logit scale: larger top-2 gaps must not flip

# Under compute-sanitizer (tools/gpu_check.sh) the four tools run side by side on one GPU: there the
# lifecycle and lossless tests run fewer cycles and prompts (each launch is instrumented) and the
# device-wide memory readings,
# which the other processes move, are not compared; memcheck's --leak-check full checks for leaks
# instead. The plain pytest stage runs every cycle and every memory comparison.
SHARED_GPU = os.environ.get("DFLASH_TEST_SHARED_GPU") == "1"
LIFECYCLE_CYCLES = int(os.environ.get("DFLASH_TEST_LIFECYCLE_CYCLES", "10000"))
LOSSLESS_TRIALS = int(os.environ.get("DFLASH_TEST_LOSSLESS_TRIALS", "4"))  # prompts per lossless case
LOSSLESS_TOKENS = int(os.environ.get("DFLASH_TEST_LOSSLESS_TOKENS", "48"))  # tokens generated per prompt
GRAPH_STEPS = int(os.environ.get("DFLASH_TEST_GRAPH_STEPS", "40"))  # speculative steps per graph-test run


def assert_device_memory(now, expected, what):
    if not SHARED_GPU:
        assert now == expected, what


def device_used_bytes():
    from cuda.bindings import runtime

    err, free, total = runtime.cudaMemGetInfo()
    assert err == runtime.cudaError_t.cudaSuccess
    return total - free


def warm_up(target_dir, draft_dir):
    """Loads every kernel once (module loading keeps device memory until process exit), so a
    later memory comparison sees only what our objects hold."""
    with Target.from_pretrained(target_dir, backend="cuda") as target, \
            Drafter.from_pretrained(draft_dir, target=target) as drafter:
        pydflash.generate(target, drafter, [1, 2, 3], 8)
        pydflash.generate(target, drafter, [1, 2, 3], 8, temperature=0.7, top_p=0.9, top_k=5, seed=0)


def as_f32(tensor):
    a = tensor.array
    if tensor.dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32).reshape(tensor.shape)
    return a.astype(np.float32).reshape(tensor.shape)


def lm_head_f32(target_dir):
    tensors = load_tensors(target_dir)
    head = tensors.get("lm_head.weight") or tensors["model.embed_tokens.weight"]
    return as_f32(head)


def top2_margin(logits):
    top = np.sort(logits)[-2:]
    return (top[1] - top[0]) / max(1e-6, np.abs(logits).max())


# The targets' attention: case 0 head_dim 128 (the tensor-core kernel), case 1 head_dim 64 with 8 query
# heads per kv head (two query tiles in a verify block, one in a decode step), case 2 the generator's
# head_dim 32 (the other kernel).
CASES = [
    dict(hidden_size=128, vocab_size=512, target_num_layers=4, num_layers=2, target_layer_ids=[1, 2],
         block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=256,
         target_num_heads=4, target_num_kv_heads=2, target_head_dim=128),
    dict(hidden_size=256, vocab_size=1000, target_num_layers=5, num_layers=3, target_layer_ids=[0, 2, 4],
         block_size=8, num_heads=4, num_kv_heads=4, head_dim=128, intermediate_size=512,
         target_num_heads=8, target_num_kv_heads=1, target_head_dim=64,
         use_sliding_window=True, sliding_window=12, layer_types=["sliding_attention", "full_attention",
                                                                   "sliding_attention"]),
    dict(hidden_size=128, vocab_size=300, target_num_layers=4, num_layers=1, target_layer_ids=[3],
         block_size=4, num_heads=8, num_kv_heads=1, head_dim=128, intermediate_size=200,
         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("ctx_window", [0, 40])
def test_drafter_propose_cuda_matches_host(make_pair, case, ctx_window):
    target_dir, draft_dir = make_pair(900 + case, **CASES[case])
    head = lm_head_f32(target_dir)
    rng = np.random.default_rng(case)
    with Drafter.from_pretrained(draft_dir, target_dir, backend="host", ctx_window=ctx_window) as host, \
            Drafter.from_pretrained(draft_dir, target_dir, backend="cuda", ctx_window=ctx_window) as cuda:
        width = host.feature_width
        vocab = head.shape[0]
        feats = rng.standard_normal((300, width), dtype=np.float32)
        seqs = [host.new_sequence(), cuda.new_sequence()]
        start = 37
        for s in seqs:
            s.append_context(feats[:start])
        flips = checked = 0
        for step in range(12):
            anchor = int(rng.integers(vocab))
            nd = int(rng.integers(1, host.block_size))
            drafts = [s.propose(anchor, start, nd) for s in seqs]
            hidden = [s.read_hidden() for s in seqs]
            assert np.isfinite(hidden[1]).all()
            err = np.linalg.norm(hidden[1] - hidden[0]) / np.linalg.norm(hidden[0])
            assert err < 2e-2, f"step {step}: hidden rel err {err:.3g}"
            logits = hidden[0] @ head.T
            for j, (a, b) in enumerate(zip(*drafts)):
                checked += 1
                if a != b:
                    assert top2_margin(logits[j]) < BF16_MARGIN, f"step {step} draft {j}: {a} vs {b}"
                    flips += 1
            accepted = int(rng.integers(0, nd + 1))
            for s in seqs:
                s.after_verify(accepted)
                s.append_context(feats[start:start + accepted + 1])
            start += accepted + 1
        assert flips <= max(1, checked // 20)
        for s in seqs:
            s.close()
        for d in (host, cuda):
            stats = d.pool_stats()
            assert stats["free_blocks"] == stats["total_blocks"]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_target_greedy_cuda_matches_host_until_a_near_tie(make_pair, case):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    target_dir, _ = make_pair(900 + case, **CASES[case])
    rng = np.random.default_rng(100 + case)
    prompt = rng.integers(0, 300, size=45).tolist()
    outs = {}
    for backend in ("host", "cuda"):
        with Target.from_pretrained(target_dir, backend=backend, prefill_chunk=16) as target:
            outs[backend] = pydflash.generate(target, None, prompt, 40).output_ids
    host, cuda = outs["host"], outs["cuda"]
    if host == cuda:
        return
    first = next(i for i, (a, b) in enumerate(zip(host, cuda)) if a != b)
    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + host[:first]])).logits[0, -1].numpy()
    assert top2_margin(logits) < BF16_MARGIN, f"cuda and host part at {first} with a clear margin"


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("block_size,prompt_lengths", [(None, (1, 120)), (3, (1, 120)), (None, (500, 900))])
def test_cuda_speculative_equals_cuda_autoregressive(make_pair, case, block_size, prompt_lengths):
    """Bit-for-bit batch invariance: a row verified among a block gives the token it gives decoded alone. Long
    prompts put the keys in many attention splits (whose boundaries must not depend on the row count)."""
    _speculative_equals_autoregressive(make_pair, case, block_size, prompt_lengths, 1024)


def test_cuda_speculative_equals_cuda_autoregressive_large_capacity(make_pair):
    """The same in sequences of capacity 32768: the key count is read on the device, splits whose first
    chunk lies past the last key return at once, and the rows of a block read different numbers of
    chunks."""
    _speculative_equals_autoregressive(make_pair, 0, None, (500, 900), 32768)


def test_cuda_speculative_equals_cuda_autoregressive_few_splits():
    """The long-prompt lossless cases again in a process where attention aims at 4 blocks
    (DFLASH_ATTN_FILL=4, read once per process): one or two splits per kv head, so every split reads
    many key chunks (split s: chunks s, s + splits, ...), some of them wholly masked for a row, and
    rows decoded alone must still sum them exactly as when verified in a block. A numeric property,
    not a memory one: under the sanitizers (DFLASH_TEST_SHARED_GPU) the other tests run these kernels."""
    if SHARED_GPU:
        pytest.skip("numeric only; the sanitizer stage covers the same kernels in the other tests")
    _lossless_in_a_process({"DFLASH_ATTN_FILL": "4"})


def test_cuda_speculative_equals_cuda_autoregressive_eight_warp_attention():
    """The long-prompt lossless cases again in a process that takes the eight-warp attention kernel
    (DFLASH_ATTN_WARPS=8; the key-quarter one is the default since session 31) and its 264-block splits: each
    kernel must sum a verified row as it sums the row decoded alone."""
    if SHARED_GPU:
        pytest.skip("numeric only; the sanitizer stage covers the default kernel in the other tests")
    _lossless_in_a_process({"DFLASH_ATTN_WARPS": "8"})


def test_cuda_speculative_equals_cuda_autoregressive_wide_attention_chunks():
    """The long-prompt lossless cases again in a process whose key-quarter attention kernel reads chunks of 128 keys
    (DFLASH_ATTN_CHUNK=128, 32 keys a warp, two k16 steps of O += P V; 64 by default): a verified row must sum its
    chunks as the row decoded alone does."""
    if SHARED_GPU:
        pytest.skip("numeric only; the sanitizer stage covers the default kernel in the other tests")
    _lossless_in_a_process({"DFLASH_ATTN_CHUNK": "128"})


def _python_in_a_process(env_overrides, args):
    """Runs `python3 args` with env_overrides (switches the library reads once per process)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.update(env_overrides)
    return subprocess.run([sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), *args],
                          env=env, capture_output=True, text=True, timeout=600)


def _tests_in_a_process(env_overrides, selection, passed):
    """This file's GPU tests matching `selection` (pytest -k) in a process of their own; `passed` must pass."""
    here = os.path.dirname(os.path.abspath(__file__))
    run = _python_in_a_process(env_overrides, [
        "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
        "-k", selection, os.path.join(here, "test_cuda_paths.py")])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"{passed} passed" in run.stdout, run.stdout[-500:]


def _lossless_in_a_process(env_overrides):
    """The long-prompt lossless cases and the large-capacity one (4 tests) in a process of their own."""
    _tests_in_a_process(env_overrides, "speculative_equals_cuda_autoregressive and prompt_lengths2 or large_capacity",
                        4)


def test_cuda_speculative_equals_cuda_autoregressive_norms_inside_gemms():
    """The same lossless cases with every folded norm taken inside its GEMM (DFLASH_GEMM_FOLD_NORM=3: the kNorm
    kernels, the sums of squares from the producers' epilogues; the default since session 26 is a norm kernel
    before plain GEMMs): the GEMM's row factors must not depend on how many rows share the call."""
    if SHARED_GPU:
        pytest.skip("numeric only; the sanitizer stage covers test_ops' gemm_fused cases")
    _lossless_in_a_process({"DFLASH_GEMM_FOLD_NORM": "3"})


def test_cuda_drafter_with_norms_inside_gemms_matches_host():
    """The drafter's proposes against the host backend's with every folded norm inside its GEMM
    (DFLASH_GEMM_FOLD_NORM=3): the input norms then go into the fused q/k/v weights and hidden_norm into the
    context's K/V weight, those GEMMs norming x with the sums of squares of the down or fc before them (session
    48). The lossless cases cannot see a wrong drafter (it only costs acceptance), so this compares its hidden
    states and drafts: the 6 cases of test_drafter_propose_cuda_matches_host in a process of their own."""
    if SHARED_GPU:
        pytest.skip("numeric only; the sanitizer stage covers test_ops' gemm_fused cases")
    _tests_in_a_process({"DFLASH_GEMM_FOLD_NORM": "3"}, "drafter_propose_cuda_matches_host", 6)


def test_cuda_speculative_equals_cuda_autoregressive_pdl_trigger_fit():
    """The same lossless cases with DFLASH_PDL_TRIGGER=fit (session 47: GEMMs whose grid fits one wave let the next
    kernel launch at their start): the trigger only moves when the next kernel's blocks are scheduled, so the
    tokens must be the same, and nothing may hang while early dependents wait beside the GEMM's blocks."""
    if SHARED_GPU:
        pytest.skip("numeric only; the sanitizer stage covers the default trigger in the other tests")
    _lossless_in_a_process({"DFLASH_PDL_TRIGGER": "fit"})


def test_cuda_speculative_equals_cuda_autoregressive_copied_downloads():
    """The same lossless cases with DFLASH_MAPPED_DOWNLOAD=0: a step's result by a device-to-host copy, as before
    session 49 (the default since: a kernel's stores to mapped pinned memory, which every other GPU test reads its
    tokens through, so a stale or torn read there would change them)."""
    if SHARED_GPU:
        pytest.skip("numeric only; the copy is the runtime's")
    _lossless_in_a_process({"DFLASH_MAPPED_DOWNLOAD": "0"})


def test_cuda_speculative_equals_cuda_autoregressive_rope_tail():
    """The same lossless cases with DFLASH_QKV_ROPE_TAIL=1 (session 50: the q/k/v heads' norm, rotation and cache
    writes in the q/k/v GEMM's epilogue, by the last column block of each head to store its part, instead of a
    kernel after the GEMM): a head read before every block of it has stored, or a counter left non-zero, changes
    the verified tokens."""
    if SHARED_GPU:
        pytest.skip("numeric only; test_ops' gemm_qkv_rope cases run the tail under the sanitizers")
    _lossless_in_a_process({"DFLASH_QKV_ROPE_TAIL": "1"})


def test_cuda_drafter_with_rope_tail_matches_host():
    """The drafter against the host backend with DFLASH_QKV_ROPE_TAIL=1 (its q/k/v GEMM's rope step in the
    GEMM's epilogue; the lossless cases cannot see a wrong drafter), and graph replays against eager launches
    with it: the 6 cases of test_drafter_propose_cuda_matches_host and test_graph_replays_equal_eager_launches in
    a process of their own."""
    if SHARED_GPU:
        pytest.skip("numeric only; test_ops' gemm_qkv_rope cases run the tail under the sanitizers")
    _tests_in_a_process({"DFLASH_QKV_ROPE_TAIL": "1"},
                        "drafter_propose_cuda_matches_host or graph_replays_equal_eager_launches", 7)


@pytest.mark.parametrize("variable,value", [("DFLASH_GEMM_FOLD_NORM", "7"), ("DFLASH_SMEM_CARVEOUT", "101"),
                                            ("DFLASH_PDL_TRIGGER", "sometimes"), ("DFLASH_GEMM_PERSIST", "4"),
                                            ("DFLASH_ATTN_CHUNK", "96")])
def test_a_bad_switch_fails_naming_the_variable(make_pair, variable, value):
    """A switch out of its range (DFLASH_GEMM_FOLD_NORM and DFLASH_GEMM_PERSIST outside 0-3, DFLASH_SMEM_CARVEOUT
    outside -1-100, DFLASH_PDL_TRIGGER not auto, fit, early, late or issued, DFLASH_ATTN_CHUNK not 64 or 128) fails the
    call that first reads it (loading or the first forward) with DFLASH_STATUS_INVALID_ARGUMENT naming it."""
    target_dir, _ = make_pair(900, **CASES[0])
    script = ("import sys, pydflash\n"
              "try:\n"
              "    with pydflash.Target.from_pretrained(sys.argv[1], backend='cuda') as t:\n"
              "        pydflash.generate(t, None, [1, 2, 3], 2)\n"
              "except pydflash.DflashError as e:\n"
              "    print('ERROR', e.status_name, e.message)\n")
    run = _python_in_a_process({variable: value}, ["-c", script, target_dir])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "ERROR DFLASH_STATUS_INVALID_ARGUMENT" in run.stdout, run.stdout[-1000:]
    assert f"{variable}={value}" in run.stdout, run.stdout[-1000:]


def _speculative_equals_autoregressive(make_pair, case, block_size, prompt_lengths, max_seq_len):
    target_dir, draft_dir = make_pair(900 + case, **CASES[case])
    rng = np.random.default_rng(7 + case + prompt_lengths[0])
    with Target.from_pretrained(target_dir, backend="cuda", max_seq_len=max_seq_len) as target, \
            Drafter.from_pretrained(draft_dir, target=target, max_seq_len=max_seq_len) as drafter:
        for trial in range(LOSSLESS_TRIALS):
            prompt = rng.integers(0, 300, size=int(rng.integers(*prompt_lengths))).tolist()
            ar = pydflash.generate(target, None, prompt, LOSSLESS_TOKENS).output_ids
            spec = pydflash.generate(target, drafter, prompt, LOSSLESS_TOKENS, block_size=block_size)
            assert spec.output_ids == ar, f"trial {trial}"
        for obj in (target, drafter):
            stats = obj.pool_stats()
            assert stats["free_blocks"] == stats["total_blocks"]


def _graph_run(target_dir, draft_dir, seed):
    """Speculative steps of random widths on two interleaved sequences (greedy and sampled), plus
    autoregressive decode steps: every (drafts, accepted, next) and the drafter's last hidden
    states, how many target forwards were replayed from graphs, and, per drafter sequence, its proposes'
    graph replays and how many of its proposes repeated a block width and projected row count it had proposed
    with before (both sequences draft greedily: argmax drafts, sampled or greedy verification)."""
    rng = np.random.default_rng(seed)
    record, replays, widths, repeated = [], 0, [set(), set()], [0, 0]
    with Target.from_pretrained(target_dir, backend="cuda", max_seq_len=1024, max_batch=3) as target, \
            Drafter.from_pretrained(draft_dir, target=target, max_seq_len=1024, max_batch=2) as drafter:
        sampling = [None, pydflash.SamplingParams(temperature=0.8, top_p=0.9, seed=11)]
        pairs = [(target.new_sequence(), drafter.new_sequence()) for _ in sampling]
        tokens = []
        for (tseq, dseq), s in zip(pairs, sampling):
            prompt = rng.integers(0, 300, size=int(rng.integers(1, 200))).tolist()
            tokens.append(tseq.prefill(prompt, sampling=s, capture=dseq))
        ar = target.new_sequence()
        ar_token = ar.prefill(rng.integers(0, 300, size=70).tolist())
        for step in range(GRAPH_STEPS):
            i = step % 2
            (tseq, dseq), s = pairs[i], sampling[i]
            nd = int(rng.integers(1, drafter.block_size))
            # one graph per block width (nd + 1 rows), projected rows (the pending context rows, projected inside
            # it, padded to a multiple of 16 up to the drafter's 64-row chunk) and sequence
            pending = dseq.info()["pending_rows"]
            shape = (nd + 1, min(64, -(-pending // 16) * 16))
            drafts = dseq.propose(tokens[i], tseq.info()["length"], nd, sampling=s)
            repeated[i] += shape in widths[i]
            widths[i].add(shape)
            accepted, tokens[i] = tseq.verify([tokens[i], *drafts], sampling=s, drafter_seq=dseq)
            dseq.after_verify(accepted)
            record.append((drafts, accepted, tokens[i], dseq.read_hidden().tobytes()))
            _, ar_token = ar.verify([ar_token])
            record.append(ar_token)
        for seq in (ar, *[t for t, _ in pairs]):
            replays += seq.info()["graph_replays"]
        draft_replays = [d.info()["graph_replays"] for _, d in pairs]
    return record, replays, draft_replays, repeated


def test_graph_replays_equal_eager_launches(make_pair, monkeypatch):
    """A verify / decode forward, and a greedy propose's block, replayed from a CUDA graph compute
    exactly what their kernels launched one by one compute (DFLASH_CUDA_GRAPHS=0): the same drafts,
    acceptances, bonus tokens and, bit for bit, the drafter hidden states fed by the captured features,
    over widths that come and go (the attention scratch grows mid-run, which re-records stale graphs) on
    interleaved sequences. Every propose of a width and projected row count its sequence proposed with before
    replays."""
    for case in (0, 1):
        target_dir, draft_dir = make_pair(900 + case, **CASES[case])
        monkeypatch.setenv("DFLASH_CUDA_GRAPHS", "1")
        graphed, replays, draft_replays, repeated = _graph_run(target_dir, draft_dir, seed=case)
        monkeypatch.setenv("DFLASH_CUDA_GRAPHS", "0")
        eager, eager_replays, eager_draft_replays, _ = _graph_run(target_dir, draft_dir, seed=case)
        assert eager_replays == 0 and eager_draft_replays == [0, 0]
        # 20 proposes per sequence over at most 15 widths repeat at least 5 (a short sanitizer run may repeat none).
        assert min(repeated) > 0 or GRAPH_STEPS < 40, f"case {case}: no propose repeated a width"
        assert draft_replays == repeated, f"case {case}: propose replays {draft_replays}, {repeated} expected"
        # 40 steps replay at least 39 of the 80 forwards (widths come back; a grown attention scratch
        # re-records); a shorter run (the sanitizer stage) only has to replay at all.
        need = GRAPH_STEPS - 1 if GRAPH_STEPS >= 40 else 1
        assert replays >= need, f"case {case}: only {replays} of {2 * GRAPH_STEPS} forwards were replayed"
        for i, (a, b) in enumerate(zip(graphed, eager)):
            assert a == b, f"case {case}, record {i}: graph replay differs from eager launches"


def test_step_timing_reports_each_span(make_pair):
    """DFLASH_STEP_TIMING=1 (a diagnostic) prints, when the target is freed, the medians of a graphed step's host and
    GPU spans: a few decode steps replay the graph, so every span is there and the graph's span is positive."""
    if SHARED_GPU:
        pytest.skip("a diagnostic's output, not memory safety")
    target_dir, _ = make_pair(900, **CASES[0])
    script = ("import sys, pydflash\n"
              "with pydflash.Target.from_pretrained(sys.argv[1], backend='cuda') as t:\n"
              "    pydflash.generate(t, None, [1, 2, 3], 12)\n")
    run = _python_in_a_process({"DFLASH_STEP_TIMING": "1"}, ["-c", script, target_dir])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = [l for l in run.stderr.splitlines() if l.startswith("dflash step timing:")]
    for span in ("host  entry -> launch", "host  launch", "gpu   entry -> pre-launch", "gpu   pre-launch -> launched",
                 "gpu   launched -> copied"):
        assert any(span in l for l in lines), (span, run.stderr[-2000:])
    graph = next(l for l in lines if "pre-launch -> launched" in l)
    assert float(graph.split("median")[1].split("us")[0]) > 0, graph
    plain = _python_in_a_process({}, ["-c", script, target_dir])
    assert plain.returncode == 0 and "dflash step timing" not in plain.stderr


def test_cuda_sampling_runs_and_is_seeded(make_pair):
    target_dir, draft_dir = make_pair(900, **CASES[0])
    with Target.from_pretrained(target_dir, backend="cuda") as target, \
            Drafter.from_pretrained(draft_dir, target=target) as drafter:
        kw = dict(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
        a = pydflash.generate(target, drafter, [1, 2, 3], 32, **kw)
        b = pydflash.generate(target, drafter, [1, 2, 3], 32, **kw)
        assert a.output_ids == b.output_ids
        c = pydflash.generate(target, drafter, [1, 2, 3], 32, draft_mode="sample", **kw)
        assert len(c.output_ids) == 32


def test_ten_thousand_cycles_return_device_memory(make_pair):
    target_dir, draft_dir = make_pair(900, **CASES[0])
    warm_up(target_dir, draft_dir)
    before = device_used_bytes()
    with Drafter.from_pretrained(draft_dir, target_dir, backend="cuda", max_batch=2) as d:
        feats = np.random.default_rng(0).standard_normal((24, d.feature_width), dtype=np.float32)
        with d.new_sequence() as warm:  # first use sizes the kernels' scratch
            warm.append_context(feats)
            warm.propose(1, 24, 15)
            warm.after_verify(0)
        during = device_used_bytes()
        for cycle in range(LIFECYCLE_CYCLES):
            with d.new_sequence() as seq:
                seq.append_context(feats[: 1 + cycle % 24])
                drafts = seq.propose(cycle % 500, 1 + cycle % 24, 1 + cycle % 15)
                seq.after_verify(cycle % (len(drafts) + 1))
        assert_device_memory(device_used_bytes(), during, "steady-state cycles allocated device memory")
        stats = d.pool_stats()
        assert stats["free_blocks"] == stats["total_blocks"]
    assert_device_memory(device_used_bytes(), before, "the drafter's memory was not all returned")


def test_out_of_memory_is_clean(make_pair):
    target_dir, draft_dir = make_pair(900, **CASES[0])
    warm_up(target_dir, draft_dir)
    before = device_used_bytes()
    with pytest.raises(DflashError) as info:
        # ~ 10^6 sequences of 4096 tokens: far beyond 141 GB of KV
        Target.from_pretrained(target_dir, backend="cuda", max_batch=60000, max_seq_len=1 << 16)
    assert info.value.status_name == "DFLASH_STATUS_OUT_OF_MEMORY", info.value
    assert "cudaMalloc" in info.value.message
    # At most what was in use before: the driver may hand back memory it kept after the warm-up's
    # CUDA graphs were destroyed (seen on the H200: 2 MiB less after than before), never more.
    now = device_used_bytes()
    assert SHARED_GPU or now <= before, f"a failed create left {now - before} bytes of device memory behind"
    with Target.from_pretrained(target_dir, backend="cuda") as target:  # the GPU still works
        assert len(pydflash.generate(target, None, [1, 2], 4).output_ids) == 4


def test_smoke_cuda_paths(make_pair):
    """Small and quick: every cuda op family once (the sanitizer runs use this test)."""
    target_dir, draft_dir = make_pair(901, **CASES[1])
    with Target.from_pretrained(target_dir, backend="cuda", prefill_chunk=8) as target, \
            Drafter.from_pretrained(draft_dir, target=target, ctx_window=16) as drafter:
        prompt = list(range(1, 30))
        greedy = pydflash.generate(target, drafter, prompt, 12)
        assert greedy.output_ids == pydflash.generate(target, None, prompt, 12).output_ids
        for mode in ("greedy", "sample"):
            out = pydflash.generate(target, drafter, prompt, 12, temperature=0.9, top_p=0.8,
                                    top_k=20, seed=3, draft_mode=mode)
            assert len(out.output_ids) == 12
        for obj in (target, drafter):
            stats = obj.pool_stats()
            assert stats["free_blocks"] == stats["total_blocks"]
