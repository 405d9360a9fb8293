"""The shipped default pair (pydflash/models/default, trained by tools/train_default.sh) on its shipped held-out
prompts: host greedy speculative decoding is lossless, its acceptance lengths are Z Lab's reference's
(`dflash.model.dflash_generate`, torch fp32 on CPU) step for step, and the mean acceptance length is what the pair
was trained to reach.

Everything skips, saying why, when the package carries no trained pair (the default is then the generated random
pair, whose drafts are essentially never accepted). Needs the library (DFLASH_LIBRARY); the reference part also
needs torch, transformers and dflash.
"""

import json

import pytest

import pydflash
from pydflash import _ffi, default_model

pytestmark = pytest.mark.skipif(
    not default_model.shipped_pair_present(),
    reason=f"no trained default pair in {default_model.SHIPPED_DIR} (only the generated random pair is available); "
           f"tools/README.md says how to train and unpack one")

MAX_NEW_TOKENS = 64
REFERENCE_PROMPTS = 4        # prompts also decoded by the reference (the slow part)
MIN_MEAN_ACCEPTANCE = 3.5    # tokens per verify step, bonus included, pooled over the shipped prompts
TIE_RTOL = 1e-5              # relative top-2 drafter logit gap below which two fp32 implementations may differ


@pytest.fixture(scope="module")
def pair():
    return default_model.SHIPPED_DIR / "target", default_model.SHIPPED_DIR / "draft"


@pytest.fixture(scope="module")
def prompts():
    with open(default_model.SHIPPED_DIR / "prompts.json", encoding="utf-8") as f:
        texts = json.load(f)["prompts"]
    assert texts and texts == default_model.default_prompts()
    return [list(text.encode("utf-8")) for text in texts]


@pytest.fixture(scope="module")
def host_runs(pair, prompts):
    """[(speculative GenerationResult, autoregressive GenerationResult)] per prompt, host backend, greedy, stopping
    at EOS as `pydflash bench` does."""
    try:
        _ffi.load()
    except ImportError as e:
        pytest.skip(f"libdflash not loadable: {e}")
    target_dir, draft_dir = pair
    runs = []
    with pydflash.Target.from_pretrained(target_dir, backend="host", max_seq_len=1024) as target, \
            pydflash.Drafter.from_pretrained(draft_dir, target=target, max_seq_len=1024) as drafter:
        stop = list(target.config.eos_token_ids)
        for ids in prompts:
            spec = pydflash.generate(target, drafter, ids, MAX_NEW_TOKENS, stop_token_ids=stop)
            ar = pydflash.generate(target, None, ids, MAX_NEW_TOKENS, stop_token_ids=stop)
            runs.append((spec, ar))
    return runs


def test_shipped_pair_is_the_default(pair, tmp_path):
    target_dir, draft_dir = default_model.ensure_default_model(tmp_path / "cache")
    for ours, shipped in ((target_dir, pair[0]), (draft_dir, pair[1])):
        for name in ("config.json", "model.safetensors"):
            assert (ours / name).read_bytes() == (shipped / name).read_bytes()
    assert default_model.VERSION == default_model.TRAINED_VERSION
    config = json.loads((pair[1] / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == default_model.MASK_TOKEN_ID
    size = sum((d / "model.safetensors").stat().st_size for d in pair)
    assert size <= 32 * 10**6, f"shipped weights are {size / 1e6:.1f} MB"


def test_host_speculative_equals_autoregressive(host_runs):
    for i, (spec, ar) in enumerate(host_runs):
        assert spec.output_ids == ar.output_ids, f"prompt {i}: speculative output differs from autoregressive"


def test_acceptance_lengths_equal_reference(pair, prompts, host_runs):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("dflash")
    import oracle

    target_dir, draft_dir = pair
    compared, ties = 0, []
    for i, ids in enumerate(prompts[:REFERENCE_PROMPTS]):
        spec = host_runs[i][0]
        new_ids, lengths, details = oracle.reference_dflash_generate(
            str(draft_dir), str(target_dir), ids, MAX_NEW_TOKENS, stop_token_ids=[default_model.EOS_TOKEN_ID],
            with_details=True)
        if (new_ids, lengths) != (spec.output_ids, spec.acceptance_lengths) and details["min_margin"] < TIE_RTOL:
            ties.append(i)  # the reference's drafter had a near-tie: another fp32 drafter may draft otherwise
            continue
        assert new_ids == spec.output_ids, f"prompt {i}: output differs from dflash_generate's"
        assert lengths == spec.acceptance_lengths, f"prompt {i}: acceptance lengths differ from dflash_generate's"
        compared += 1
    assert compared >= REFERENCE_PROMPTS - 1, f"near-ties on prompts {ties}: too few compared"


def test_mean_acceptance_length(host_runs):
    tokens = sum(len(spec.output_ids) for spec, _ in host_runs)
    steps = sum(spec.num_steps for spec, _ in host_runs)
    mean = tokens / steps
    per_prompt = [round(spec.mean_acceptance_length, 2) for spec, _ in host_runs]
    assert mean >= MIN_MEAN_ACCEPTANCE, f"mean acceptance {mean:.3f} < {MIN_MEAN_ACCEPTANCE} (per prompt {per_prompt})"
