"""Checks of the test tooling itself (checkpoint writer, reference harness) against independent ground truth:
transformers/dflash loaders, torch's own bf16 rounding, dflash_generate itself, and uncached forwards."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
dfm = pytest.importorskip("dflash.model")
from safetensors.torch import load_file  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import make_checkpoint  # noqa: E402
import oracle  # noqa: E402

SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5, use_sliding_window=True)
# max_position_embeddings = factor * original, else transformers warns that the two disagree.
YARN = dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
            max_position_embeddings=1024)
SCENARIOS = {
    "plain": dict(block_size=8),
    "tied_gqa4": dict(block_size=6, tie_word_embeddings=True, num_heads=8, num_kv_heads=2, head_dim=16),
    "sliding": dict(block_size=8, **SLIDING),
    "sliding_noncausal": dict(block_size=8, is_causal=False, **SLIDING),
    "yarn_scaled": dict(block_size=8, rope_style="parameters", rope_theta=50000.0, input_embedding_scale=1.5,
                        output_multiplier=0.7, final_logit_softcapping=3.0, **YARN),
    "three_ids": dict(block_size=16, num_layers=3, target_layer_ids=[0, 2, 3], target_num_layers=5),
}


def _load_all(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


# --- checkpoint writer ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("shards", [1, 3])
def test_checkpoints_load_without_missing_or_unexpected_keys(make_pair, scenario, shards):
    kwargs = SCENARIOS[scenario]
    target_dir, draft_dir = make_pair(3, shards=shards, **kwargs)
    target, info = transformers.Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info.values()), info
    drafter, info = dfm.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info

    n_target = kwargs.get("target_num_layers", 4)
    expected_ids = kwargs.get("target_layer_ids") or make_checkpoint.build_target_layer_ids(
        n_target, kwargs.get("num_layers", 2))
    assert drafter.target_layer_ids == expected_ids
    assert expected_ids == dfm.build_target_layer_ids(n_target, kwargs.get("num_layers", 2)) or \
        "target_layer_ids" in kwargs
    assert drafter.block_size == kwargs["block_size"]
    assert drafter.mask_token_id == target.config.vocab_size - 1
    assert drafter.fc.weight.shape == (64, len(expected_ids) * 64)
    if kwargs.get("tie_word_embeddings"):
        assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    # Loaded weights are exactly the bf16 values on disk (no re-initialisation slipped in).
    on_disk = _load_all(draft_dir)
    for name, param in drafter.state_dict().items():
        assert torch.equal(param, on_disk[name].float()), name


def test_cli_writes_the_same_checkpoint_as_the_api(tmp_path):
    make_checkpoint.main(["target", str(tmp_path / "t"), "--hidden", "32", "--layers", "3", "--tie", "--seed", "9"])
    make_checkpoint.main(["drafter", str(tmp_path / "d"), "--target", str(tmp_path / "t"), "--layers", "1",
                          "--block-size", "4", "--layer-types", "sliding_attention", "--sliding-window", "8",
                          "--use-sliding-window", "true", "--rope-scaling", json.dumps(YARN["rope_scaling"])])
    make_checkpoint.make_target(str(tmp_path / "t2"), hidden_size=32, num_layers=3, tie_word_embeddings=True, seed=9)
    a, b = _load_all(str(tmp_path / "t")), _load_all(str(tmp_path / "t2"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    with open(tmp_path / "d" / "config.json") as f:
        config = json.load(f)
    assert config["num_hidden_layers"] == 1 and config["block_size"] == 4 and config["hidden_size"] == 32
    assert config["layer_types"] == ["sliding_attention"] and config["use_sliding_window"] is True
    assert config["rope_scaling"] == YARN["rope_scaling"] and config["dflash_config"]["target_layer_ids"] == [1]


def test_build_target_layer_ids_matches_reference():
    for n_target in range(4, 70):
        for n_draft in range(1, 9):
            assert make_checkpoint.build_target_layer_ids(n_target, n_draft) == \
                dfm.build_target_layer_ids(n_target, n_draft)


def _awkward_floats(rng):
    """Random data across scales plus bit patterns that stress rounding: exact ties (low half 0x8000) with even
    and odd kept halves, both signs, subnormals, the overflow edge, infinities and zeros."""
    x = np.concatenate([rng.standard_normal(4096) * s for s in (1e-30, 1e-3, 1.0, 1e4, 1e30)]).astype(np.float32)
    upper = rng.integers(0, 0x10000, 4096, dtype=np.uint32)
    upper = upper[(upper & 0x7F80) != 0x7F80]  # keep finite
    ties = ((upper << 16) | 0x8000).view(np.float32)
    near = ((upper << 16) | rng.choice([0x7FFF, 0x8001, 0x0001, 0xFFFF], upper.size).astype(np.uint32))
    bits = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00000001, 0x80008000, 0x00018000, 0x7F800000,
                     0xFF800000, 0x00000000, 0x80000000], dtype=np.uint32)
    return np.concatenate([x, ties, near.view(np.float32), bits.view(np.float32)])


def test_bf16_rounding_matches_torch_bit_for_bit():
    x = _awkward_floats(np.random.default_rng(7))
    ours = make_checkpoint.float32_to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs), np.flatnonzero(ours != theirs)[:10]
    nan = make_checkpoint.float32_to_bf16_bits(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(torch.from_numpy(nan.view(np.int16)).view(torch.bfloat16).float().numpy()).all()


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                               ("float32", torch.float32)])
def test_safetensors_writer_round_trip(tmp_path, dtype, torch_dtype):
    rng = np.random.default_rng(11)
    x = _awkward_floats(rng)
    if dtype == "float16":
        x = x[np.abs(x) < 6e4]  # numpy and torch agree on f16 rounding, but keep clear of overflow
    tensors = {"b.odd": x[:7 * 13].reshape(7, 13), "a.flat": x, "c.scalarish": x[:1]}
    path = tmp_path / "t.safetensors"
    make_checkpoint.write_safetensors(str(path), tensors, dtype)
    loaded = load_file(str(path))
    assert sorted(loaded) == sorted(tensors)
    for name, value in tensors.items():
        expect = torch.from_numpy(value).to(torch_dtype)
        assert loaded[name].dtype == torch_dtype and loaded[name].shape == expect.shape
        bits = torch.int16 if torch_dtype != torch.float32 else torch.int32
        assert torch.equal(loaded[name].view(bits), expect.view(bits)), name
    head_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert head_len % 8 == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sharded_and_single_file_give_identical_tensors(tmp_path, dtype):
    single = make_checkpoint.make_target(str(tmp_path / "single"), seed=5, dtype=dtype)
    sharded = make_checkpoint.make_target(str(tmp_path / "sharded"), seed=5, dtype=dtype, shards=4)
    a, b = _load_all(single), _load_all(sharded)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert sorted(index["weight_map"]) == sorted(a)
    assert len(set(index["weight_map"].values())) == 4
    assert not os.path.exists(os.path.join(sharded, "model.safetensors"))
    # Same seed -> same values whatever the file dtype (drawn in fp32, rounded on write).
    if dtype == "float32":
        c = _load_all(make_checkpoint.make_target(str(tmp_path / "bf"), seed=5))
        assert all(torch.equal(a[n].to(torch.bfloat16), c[n]) for n in a)


# --- reference drafter ------------------------------------------------------------------------------------------

def _record_dflash_generate(target_dir, draft_dir, prompt, max_new_tokens):
    """Run dflash_generate itself on fresh model instances, recording each drafter call:
    (target_hidden, position_ids, draft_hidden, draft_logits)."""
    target = transformers.Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = dfm.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    calls = []

    def hook(module, args, kwargs, output):
        calls.append({"ctx": kwargs["target_hidden"][0].clone(), "pos": kwargs["position_ids"][0].clone()})

    drafter.register_forward_hook(hook, with_kwargs=True)
    compute_logits = drafter.compute_logits

    def record_logits(hidden, head):
        logits = compute_logits(hidden, head)
        calls[-1].update(hidden=hidden[0].clone(), logits=logits[0].clone())
        return logits

    drafter.compute_logits = record_logits
    out = dfm.dflash_generate(drafter, target, torch.tensor([prompt]), max_new_tokens, None)
    return out[0].tolist(), calls


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_reference_drafter_replays_dflash_generate_exactly(make_pair, scenario):
    target_dir, draft_dir = make_pair(21, **SCENARIOS[scenario])
    prompt = np.random.default_rng(4).integers(0, 511, 13).tolist()
    output_ids, calls = _record_dflash_generate(target_dir, draft_dir, prompt, 40)
    assert len(calls) >= 5

    ref = oracle.ReferenceDrafter(draft_dir, target_dir)
    for call in calls:
        ctx, pos = call["ctx"].numpy(), call["pos"]
        start = int(pos[ctx.shape[0]])  # first noise position = the anchor's position
        ref.append_context(ctx)
        drafts, hidden = ref.propose(output_ids[start], start, len(pos) - ctx.shape[0] - 1)
        assert torch.equal(torch.from_numpy(hidden), call["hidden"])
        assert np.array_equal(ref.last_logits, call["logits"].numpy())
        assert drafts == call["logits"].argmax(-1).tolist()
        # The anchor's committed successor is the first draft exactly when the target accepted it.
        ref.after_verify(int(output_ids[start + 1] == drafts[0]))


@torch.inference_mode()
def _uncached_propose(ref, ctx_rows, position, last_token, B):
    """One drafter step straight through the model with no cache: all given context rows fed at once."""
    ids = torch.tensor([[last_token] + [ref.mask_token_id] * (B - 1)])
    noise = F.embedding(ids, ref.embed) * ref.embed_scale
    hidden = ref.model(target_hidden=torch.from_numpy(ctx_rows)[None], noise_embedding=noise,
                       position_ids=torch.arange(position - ctx_rows.shape[0], position + B)[None])[:, 1 - B:]
    logits = ref.model.compute_logits(hidden, ref.head)
    return logits[0].argmax(-1).tolist(), hidden[0].numpy()


# (new context rows, requested drafts): 0 and 40 exercise the clamp of B to [2, block_size].
STEPS = [(9, 7), (1, 3), (4, 0), (1, 40), (6, 15), (2, 5), (3, 7), (1, 1)]


def _walk(ref, target_dir, steps=STEPS, seed=0):
    """Drive `ref` through steps of real target features; yields (all rows so far, position, token, B, result)."""
    n = sum(k for k, _ in steps)
    tokens = np.random.default_rng(seed).integers(0, 511, n + 1).tolist()
    feats = oracle.target_features(target_dir, tokens[:n], ref.model.target_layer_ids)
    pos = 0
    for new_rows, num_drafts in steps:
        ref.append_context(feats[pos:pos + new_rows])
        pos += new_rows
        drafts, hidden = ref.propose(tokens[pos], pos, num_drafts)
        B = max(2, min(num_drafts + 1, ref.block_size))
        assert len(drafts) == B - 1 and hidden.shape == (B - 1, ref.config.hidden_size)
        yield feats[:pos], pos, tokens[pos], B, (drafts, hidden)
        ref.after_verify(0)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_cached_steps_equal_uncached_forward(make_pair, scenario):
    """Context K/V carried in the cache across steps == recomputing it from all rows in one forward."""
    target_dir, draft_dir = make_pair(22, **SCENARIOS[scenario])
    ref = oracle.ReferenceDrafter(draft_dir, target_dir)
    for rows, pos, token, B, (drafts, hidden) in _walk(ref, target_dir):
        want_drafts, want_hidden = _uncached_propose(ref, rows, pos, token, B)
        np.testing.assert_allclose(hidden, want_hidden, rtol=1e-5, atol=1e-5)
        assert drafts == want_drafts


@pytest.mark.parametrize("scenario", ["plain", "sliding", "yarn_scaled"])
def test_ctx_window_larger_than_context_is_no_cap(make_pair, scenario):
    target_dir, draft_dir = make_pair(23, **SCENARIOS[scenario])
    capped = _walk(oracle.ReferenceDrafter(draft_dir, target_dir, ctx_window=1000), target_dir)
    plain = _walk(oracle.ReferenceDrafter(draft_dir, target_dir), target_dir)
    for (*_, (d1, h1)), (*_, (d2, h2)) in zip(capped, plain, strict=True):
        assert d1 == d2 and np.array_equal(h1, h2)


@pytest.mark.parametrize("scenario", ["plain", "sliding", "sliding_noncausal", "yarn_scaled"])
@pytest.mark.parametrize("window", [1, 3, 8])
def test_ctx_window_equals_uncached_forward_on_newest_rows(make_pair, scenario, window):
    target_dir, draft_dir = make_pair(24, **SCENARIOS[scenario])
    ref = oracle.ReferenceDrafter(draft_dir, target_dir, ctx_window=window)
    for rows, pos, token, B, (drafts, hidden) in _walk(ref, target_dir):
        want_drafts, want_hidden = _uncached_propose(ref, rows[-window:], pos, token, B)
        np.testing.assert_allclose(hidden, want_hidden, rtol=1e-5, atol=1e-5)
        assert drafts == want_drafts


def test_target_features_match_reference_prefill(make_pair):
    """target_features == the hidden states dflash_generate's prefill hands to the drafter first."""
    target_dir, draft_dir = make_pair(21, **SCENARIOS["plain"])
    prompt = np.random.default_rng(4).integers(0, 511, 13).tolist()
    _, calls = _record_dflash_generate(target_dir, draft_dir, prompt, 4)
    layer_ids = oracle.load_drafter(draft_dir).target_layer_ids
    np.testing.assert_allclose(oracle.target_features(target_dir, prompt, layer_ids), calls[0]["ctx"].numpy(),
                               rtol=1e-5, atol=1e-5)


# --- Llama targets ----------------------------------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("tied,rope_scaling,shards", [(False, None, 1), (True, LLAMA3, 3), (False, LLAMA3, 1),
                                                      (True, None, 1)])
def test_llama_checkpoint_loads_without_missing_or_unexpected_keys(make_pair, tied, rope_scaling, shards):
    target_dir, draft_dir = make_pair(31, arch="llama", target_rope_scaling=rope_scaling, tie_word_embeddings=tied,
                                      shards=shards, target_num_heads=8, target_num_kv_heads=2, target_head_dim=16,
                                      block_size=4)
    target, info = transformers.LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info.values()), info
    assert target.config.model_type == "llama" and target.config.head_dim == 16
    assert target.config.num_key_value_heads == 2 and target.config.tie_word_embeddings is tied
    expected_rope = {"rope_type": "default"} if rope_scaling is None else dict(rope_scaling)
    assert target.config.rope_parameters == {**expected_rope, "rope_theta": 10000.0}
    on_disk = _load_all(target_dir)
    assert not any("q_norm" in n or "k_norm" in n for n in on_disk), "Llama has no q/k norm"
    assert ("lm_head.weight" in on_disk) is not tied
    for name, param in target.state_dict().items():
        stored = on_disk.get(name, on_disk.get("model.embed_tokens.weight") if name == "lm_head.weight" else None)
        assert stored is not None and torch.equal(param, stored.float()), name
    # The drafter is built for, and runs against, a Llama target.
    drafter, info = dfm.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    prompt = np.random.default_rng(2).integers(0, 511, 70).tolist()  # past original_max_position_embeddings
    ids, lengths = oracle.reference_dflash_generate(draft_dir, target_dir, prompt, 12)
    assert ids == oracle.target_greedy(target_dir, prompt, 12) and sum(lengths) == 11


def test_llama3_rope_changes_the_model(make_pair):
    """rope_scaling reaches transformers: the same weights with and without llama3 scaling decode differently
    on a prompt longer than original_max_position_embeddings (so a loader ignoring it would be caught)."""
    prompt = np.random.default_rng(3).integers(0, 511, 200).tolist()
    plain, _ = make_pair(32, arch="llama")
    scaled, _ = make_pair(32, arch="llama", target_rope_scaling=LLAMA3)
    assert _load_all(plain).keys() == _load_all(scaled).keys()
    a, b = oracle.load_target(plain), oracle.load_target(scaled)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        assert not torch.allclose(a(ids).logits, b(ids).logits, atol=1e-3)


def test_qwen3_arch_is_the_default(tmp_path):
    a = make_checkpoint.make_target(str(tmp_path / "a"), seed=4)
    b = make_checkpoint.make_target(str(tmp_path / "b"), seed=4, arch="qwen3", rope_scaling=None)
    for name in sorted(os.listdir(a)):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    with pytest.raises(ValueError, match="arch"):
        make_checkpoint.make_target(str(tmp_path / "c"), arch="mistral")


# --- whole-generation oracles -----------------------------------------------------------------------------------

@torch.inference_mode()
def _manual_greedy(target_dir, prompt, n):
    model = oracle.load_target(target_dir)
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_target_greedy_is_uncut_by_config_eos(make_pair, arch):
    """A config eos_token_id that the continuation emits neither stops nor alters target_greedy (transformers
    would otherwise merge it into generate); stop_token_ids cut at and including the first stop."""
    prompt = np.random.default_rng(5).integers(0, 511, 9).tolist()
    plain, _ = make_pair(33, arch=arch)
    want = _manual_greedy(plain, prompt, 25)
    with_eos, _ = make_pair(33, arch=arch, eos_token_id=want[3])
    with open(os.path.join(with_eos, "config.json")) as f:
        assert json.load(f)["eos_token_id"] == want[3]
    assert oracle.target_greedy(with_eos, prompt, 25) == want
    assert oracle.target_greedy(plain, prompt, 25, stop_token_ids=[want[3], 100000]) == want[:want.index(want[3]) + 1]
    got, margins = oracle.target_greedy(plain, prompt, 25, with_margins=True)
    assert got == want and len(margins) == 25 and min(margins) > 0


@pytest.mark.parametrize("block_size", [None, 3])
def test_reference_dflash_generate_details(make_pair, block_size):
    target_dir, draft_dir = make_pair(34, block_size=6, tie_word_embeddings=True)
    prompt = np.random.default_rng(6).integers(0, 511, 17).tolist()
    ids, lengths, details = oracle.reference_dflash_generate(draft_dir, target_dir, prompt, 23, block_size=block_size,
                                                             with_details=True)
    assert ids == oracle.target_greedy(target_dir, prompt, 23)
    assert sum(lengths) == len(ids) - 1 and len(details["drafts"]) == len(lengths)
    width = block_size or 6
    for drafts, n in zip(details["drafts"], lengths):
        assert 1 <= len(drafts) <= width - 1 and n <= len(drafts) + 1
    # The recorded drafts are what the target verified: the accepted ones are the output.
    start = 0
    for drafts, n in zip(details["drafts"], lengths):
        assert ids[start + 1:start + n] == drafts[:n - 1]
        start += n
    stop = [ids[5]]
    cut, _ = oracle.reference_dflash_generate(draft_dir, target_dir, prompt, 23, block_size=block_size,
                                              stop_token_ids=stop)
    assert cut == ids[:ids.index(stop[0]) + 1]
