"""The tiled GEMM weight layout (native/src/backend.hpp) through whole models, on the CPU.

The cuda backend stores GEMM weights tiled unless DFLASH_GEMM_TILED=0. DFLASH_HOST_TILED=1 makes the host backend
tile the same tensors the same way (it is read at each finalize), so these tests cover the models' side of it:
which tensors get tiled, the drafter's per-layer slices of its fused ctx K/V weight, a tied lm_head (it stays the
row-major embedding table), a drafter sharing its target's head and a standalone one with its own. The arithmetic
is the same, so every output of a tiled run must equal the row-major run's exactly: tokens, acceptance lengths,
drafts and the drafter's hidden states bit for bit.
"""
import numpy as np
import pytest

import pydflash
from pydflash import Drafter, Target

CASES = [
    # K = 72 and 200 (not multiples of the 64-wide tile), N = 300 (not a multiple of 16), 2 ctx K/V rows per layer
    dict(hidden_size=64, vocab_size=300, target_num_layers=3, num_layers=2, target_layer_ids=[0, 2], block_size=8,
         num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=72, target_intermediate_size=200),
    # tied embeddings: lm_head is embed_tokens, row-major, among tiled layer weights
    dict(hidden_size=128, vocab_size=512, target_num_layers=2, num_layers=1, target_layer_ids=[1], block_size=16,
         num_heads=8, num_kv_heads=1, head_dim=16, intermediate_size=128, tie_word_embeddings=True),
    # 2 * kv_width = 8 rows per layer: not a tile multiple, so the drafter keeps that fused weight row-major
    dict(hidden_size=64, vocab_size=256, target_num_layers=2, num_layers=2, target_layer_ids=[0, 1], block_size=4,
         num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=64),
]


def _run(target_dir, draft_dir, seed):
    rng = np.random.default_rng(seed)
    with Target.from_pretrained(target_dir, backend="host") as target, \
            Drafter.from_pretrained(draft_dir, target=target) as drafter:
        prompt = rng.integers(0, 256, size=int(rng.integers(5, 60))).tolist()  # every case's vocab >= 256
        spec = pydflash.generate(target, drafter, prompt, 24)
        ar = pydflash.generate(target, None, prompt, 24)
    with Drafter.from_pretrained(draft_dir, target_dir, backend="host") as alone:  # its own embed / lm_head
        feats = rng.standard_normal((20, alone.feature_width), dtype=np.float32)
        with alone.new_sequence() as seq:
            seq.append_context(feats)
            drafts = seq.propose(3, 20, alone.block_size - 1)
            hidden = seq.read_hidden().tobytes()
    return spec.output_ids, spec.acceptance_lengths, spec.drafts, ar.output_ids, drafts, hidden


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tiled_weights_compute_what_row_major_weights_compute(make_pair, monkeypatch, case):
    target_dir, draft_dir = make_pair(1200 + case, **CASES[case])
    monkeypatch.delenv("DFLASH_HOST_TILED", raising=False)
    row_major = _run(target_dir, draft_dir, seed=case)
    monkeypatch.setenv("DFLASH_HOST_TILED", "1")
    tiled = _run(target_dir, draft_dir, seed=case)
    names = ["speculative tokens", "acceptance lengths", "drafts", "autoregressive tokens", "standalone drafts",
             "standalone drafter hidden states"]
    for name, a, b in zip(names, row_major, tiled):
        assert a == b, f"case {case}: {name} differ between tiled and row-major weights"
    assert row_major[0] == row_major[3], "speculative output != autoregressive output"
