"""Norms folded into GEMMs (Backend::folds_norms) through whole models, on the CPU.

The cuda backend folds unless DFLASH_FUSED_NORM=0 (on by default since session 15): the target's input
and post-attention RMSNorms go into its q/k/v and gate/up weights, the drafter's post-attention norm into its
gate/up weight (and its input norm into its fused q/k/v weight, hidden_norm into the context's K/V weight, where
those GEMMs take the sums of squares from the GEMM before: DFLASH_GEMM_FOLD_NORM's bit 1 on cuda), the GEMMs norm
their rows themselves, and o_proj / down add into the residual stream.
DFLASH_HOST_FOLD=1 (read at each finalize) makes the host backend do the same, so these tests cover the models'
side of it with float32 checkpoints (folding a bf16 weight rounds each product to bf16, which the reference
tolerances here are too tight for; the cuda suite compares bf16 folding against the host): speculative output
equals the target's and transformers' greedy output, the drafter matches Z Lab's reference, and the fold does
change the arithmetic (the folded and unfolded hidden states are close, not identical).
"""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("dflash")

import test_drafter_reference as drafter_reference  # noqa: E402
import test_generate_lossless as lossless  # noqa: E402
from pydflash import Drafter, Target  # noqa: E402

SEEDS = range(6)


@pytest.mark.parametrize("seed", SEEDS)
def test_folded_speculative_output_is_lossless(seed, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOST_FOLD", "1")
    lossless.run_case(seed, tmp_path, dtype="float32")


@pytest.mark.parametrize("seed", SEEDS)
def test_folded_drafter_matches_reference(make_pair, seed, monkeypatch):
    monkeypatch.setenv("DFLASH_HOST_FOLD", "1")
    kw, engine, schedule = drafter_reference.random_case(seed, dtype="float32")
    excused, compared = drafter_reference.run_both(make_pair, seed, kw, engine, schedule)
    assert excused <= max(1, compared // 100), f"seed {seed}: {excused} near-tie excuses"


def _hidden(target_dir, draft_dir):
    rng = np.random.default_rng(5)
    with Target.from_pretrained(target_dir, backend="host") as target, \
            Drafter.from_pretrained(draft_dir, target=target) as drafter:
        prompt = rng.integers(0, 256, size=40).tolist()
        with target.new_sequence() as tseq, drafter.new_sequence() as dseq:
            anchor = tseq.prefill(prompt, capture=dseq)
            dseq.propose(anchor, len(prompt), drafter.block_size - 1)
            return dseq.read_hidden()


def _small_pair(make_pair, seed):
    return make_pair(seed, dtype="float32", vocab_size=256, hidden_size=64, target_num_layers=3, num_layers=2,
                     target_layer_ids=[0, 2], block_size=8)


def _assert_close_not_equal(base, other, what):
    """other is base computed another way: not bit for bit the same (else that way did not run), within 1e-5."""
    assert not np.array_equal(base, other), f"{what} changed nothing: the folded path did not run"
    err = np.linalg.norm(other - base) / np.linalg.norm(base)
    assert err < 1e-5, f"{what}: hidden states differ by {err:.2e} (relative)"


def test_folding_changes_the_arithmetic_not_the_result(make_pair, monkeypatch):
    target_dir, draft_dir = _small_pair(make_pair, 1300)
    monkeypatch.delenv("DFLASH_HOST_FOLD", raising=False)
    plain = _hidden(target_dir, draft_dir)
    monkeypatch.setenv("DFLASH_HOST_FOLD", "1")
    _assert_close_not_equal(plain, _hidden(target_dir, draft_dir), "DFLASH_HOST_FOLD=1")


def test_drafter_folds_its_input_norms_only_where_qkv_has_its_own_weight(make_pair, monkeypatch):
    """The drafter's input norms go into the block's q/k/v weight, and hidden_norm into the context rows' K/V
    weight, only where the block's q/k/v weight is a copy of its own (DFLASH_DRAFTER_FUSED_QKV, the default; with
    two GEMMs the block's K/V read the context's weight, which neither norm fits). With two GEMMs the host's q and
    K/V products are the same numbers as with one, so a difference here is the folds' alone (and
    test_folded_drafter_matches_reference holds the folded drafter to the reference)."""
    target_dir, draft_dir = _small_pair(make_pair, 1301)
    monkeypatch.setenv("DFLASH_HOST_FOLD", "1")
    monkeypatch.setenv("DFLASH_DRAFTER_FUSED_QKV", "0")
    apart = _hidden(target_dir, draft_dir)
    monkeypatch.setenv("DFLASH_DRAFTER_FUSED_QKV", "1")
    _assert_close_not_equal(apart, _hidden(target_dir, draft_dir), "one q/k/v GEMM, folded")
    monkeypatch.delenv("DFLASH_HOST_FOLD")
    plain_apart = _hidden(target_dir, draft_dir)
    monkeypatch.setenv("DFLASH_DRAFTER_FUSED_QKV", "0")
    assert np.array_equal(plain_apart, _hidden(target_dir, draft_dir)), "unfolded, one q/k/v GEMM or two differ"
