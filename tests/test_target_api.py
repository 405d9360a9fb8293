"""The target side of the Python API at unit level: TargetConfig against transformers' Qwen3Config / LlamaConfig,
SamplingParams against dflash.model's validation, Target / TargetSequence lifecycle and errors, Drafter sharing a
target, and generate()'s argument checks and result bookkeeping. (Lossless and exact-sampling tests live in their
own modules.) The parts that drive the library skip when it cannot be loaded (set DFLASH_LIBRARY)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

import make_checkpoint
from pydflash import _ffi
from pydflash.config import TargetConfig
from pydflash.sampling import SamplingParams

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
         "vocab_size": 300}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 300}


def with_(base, **kw):
    out = json.loads(json.dumps(base))
    out.update(kw)
    return out


TARGET_CASES = {
    "qwen3": QWEN3,
    "qwen3_defaults": {"model_type": "qwen3"},  # every Qwen3Config default
    "qwen3_kv_null": with_(QWEN3, num_key_value_heads=None),
    "qwen3_kv_absent": {k: v for k, v in with_(QWEN3, num_attention_heads=32, hidden_size=128).items()
                        if k != "num_key_value_heads"},  # Qwen3Config's default 32, not "as many as heads"
    "qwen3_head_dim_absent": {k: v for k, v in QWEN3.items() if k != "head_dim"},
    "qwen3_tied_eos_list": with_(QWEN3, tie_word_embeddings=True, eos_token_id=[5, 7], bos_token_id=3),
    "qwen3_yarn": with_(QWEN3, rope_theta=1e6, max_position_embeddings=8192,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}),
    "qwen3_rope_parameters": with_(QWEN3, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "qwen3_sliding_off": with_(QWEN3, use_sliding_window=False, sliding_window=16, max_window_layers=1),
    "llama": LLAMA,
    "llama_defaults": {"model_type": "llama"},
    "llama_kv_absent": {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"},
    "llama_head_dim_given": with_(LLAMA, head_dim=32),
    "llama_llama3_rope": with_(LLAMA, rope_theta=5e5, max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "llama_eos_int_tied": with_(LLAMA, eos_token_id=9, tie_word_embeddings=True),
    "llama_by_architectures_only": {k: v for k, v in LLAMA.items() if k != "model_type"},
}


@pytest.mark.parametrize("name", sorted(TARGET_CASES))
def test_target_config_matches_transformers(name):
    transformers = pytest.importorskip("transformers")
    raw = TARGET_CASES[name]
    ours = TargetConfig.from_json(raw)
    config_class = transformers.LlamaConfig if ours.arch == "llama" else transformers.Qwen3Config
    assert ours.arch == ("llama" if "llama" in name else "qwen3")
    ref = config_class.from_dict(json.loads(json.dumps(raw)))
    assert ours.num_layers == ref.num_hidden_layers
    assert ours.hidden_size == ref.hidden_size
    assert ours.intermediate_size == ref.intermediate_size
    assert ours.num_heads == ref.num_attention_heads
    assert ours.num_kv_heads == ref.num_key_value_heads
    assert ours.head_dim == ref.head_dim
    assert ours.vocab_size == ref.vocab_size
    assert ours.rms_norm_eps == ref.rms_norm_eps
    assert ours.max_position_embeddings == ref.max_position_embeddings
    assert ours.tie_word_embeddings == ref.tie_word_embeddings
    eos = ref.eos_token_id
    assert ours.eos_token_ids == ([] if eos is None else list(eos) if isinstance(eos, list) else [eos])
    assert ours.bos_token_id == ref.bos_token_id
    rp = ref.rope_parameters
    assert (ours.rope.type, ours.rope.theta) == (rp["rope_type"], rp["rope_theta"])
    if rp["rope_type"] in ("yarn", "llama3"):
        assert ours.rope.factor == rp["factor"]
        assert ours.rope.original_max_position == rp["original_max_position_embeddings"]
    if rp["rope_type"] == "llama3":
        assert (ours.rope.low_freq_factor, ours.rope.high_freq_factor) == (rp["low_freq_factor"],
                                                                           rp["high_freq_factor"])


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied_eos_list", "llama", "llama_eos_int_tied"])
def test_target_tensor_names_and_shapes_match_transformers_models(name):
    """tensor_shapes() is exactly what a transformers model of that config holds (minus the tied head)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    raw = TARGET_CASES[name]
    ours = TargetConfig.from_json(raw)
    config_class, model_class = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if ours.arch == "llama"
                                 else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM))
    model = model_class(config_class.from_dict(json.loads(json.dumps(raw))))
    ref = {(k[len("model."):] if k.startswith("model.") else k): tuple(v.shape)
           for k, v in model.state_dict().items()}
    if ours.tie_word_embeddings:
        ref.pop("lm_head.weight")
    assert ours.tensor_shapes() == ref


@pytest.mark.parametrize("raw, words", [
    ({"model_type": "mistral"}, "not supported"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "qwen3_moe"),
    ({"hidden_size": 64}, "model_type None"),
    (with_(QWEN3, use_sliding_window=True, sliding_window=16, max_window_layers=1), "sliding"),
    (with_(QWEN3, layer_types=["full_attention", "sliding_attention", "full_attention"]), "sliding"),
    (with_(QWEN3, attention_bias=True), "attention_bias"),
    (with_(LLAMA, mlp_bias=True), "mlp_bias"),
    (with_(LLAMA, hidden_act="gelu"), "hidden_act"),
    (with_(LLAMA, hidden_size=66), "not a multiple of num_attention_heads"),
    (with_(QWEN3, num_key_value_heads=3), "num_key_value_heads 3"),
    (with_(QWEN3, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    (with_(QWEN3, eos_token_id="</s>"), "eos_token_id"),
])
def test_target_config_refuses_what_the_engine_cannot_run(raw, words):
    with pytest.raises(ValueError, match=words):
        TargetConfig.from_json(raw)


def test_target_config_from_directory_reads_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(with_(QWEN3, eos_token_id=5)))
    assert TargetConfig.from_json(tmp_path).eos_token_ids == [5]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert TargetConfig.from_json(tmp_path).eos_token_ids == [5, 6]  # what transformers' generate() stops at
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert TargetConfig.from_json(tmp_path).eos_token_ids == [5]
    info = TargetConfig.from_json(tmp_path).info
    assert (info.hidden_size, info.vocab_size, info.num_hidden_layers, info.tie_word_embeddings) == (64, 300, 3, False)


# --------------------------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, -0.1, 2.0])
@pytest.mark.parametrize("top_p", [1.0, 0.5, 0.0, 1.0001, -1.0])
@pytest.mark.parametrize("top_k", [0, 5, -1])
def test_sampling_validation_matches_reference(temperature, top_p, top_k):
    dfm = pytest.importorskip("dflash.model")
    try:
        dfm._validate_sampling(temperature, top_p, top_k)
        reference_ok = True
    except ValueError:
        reference_ok = False
    if reference_ok:
        SamplingParams(temperature, top_p, top_k)
    else:
        with pytest.raises(ValueError, match="non-negative"):
            SamplingParams(temperature, top_p, top_k)


@pytest.mark.parametrize("kw, words", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "finite"), ({"top_p": math.nan}, "top_p"),
    ({"temperature": "1"}, "temperature"), ({"top_k": 2.0}, "top_k"), ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"), ({"draft_mode": "beam"}, "draft_mode"), ({"top_k": 2**31}, "int32"),
])
def test_sampling_refuses_what_c_cannot_hold(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_sampling_to_c(library):
    p = SamplingParams(0.7, 0.9, 40, 2**64 - 1, "sample").to_c(library)
    assert p.struct_size == library.ffi.sizeof("dflash_sampling_params")
    assert (round(p.temperature, 5), round(p.top_p, 5), p.top_k, p.seed, p.draft_mode) == (
        0.7, 0.9, 40, 2**64 - 1, library.lib.DFLASH_DRAFT_SAMPLE)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.1).greedy


# --------------------------------------------------------------------------------------------------------------
# Target and TargetSequence against the library
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def library():
    try:
        return _ffi.load()
    except ImportError as e:
        pytest.skip(f"libdflash not loadable: {e}")


def _full(stats):
    return stats["free_blocks"] == stats["total_blocks"]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_target_lifecycle(library, make_pair, arch):
    from pydflash import DflashError, Target

    target_dir, _ = make_pair(21, target_arch=arch, vocab_size=97, block_size=4)
    with Target.from_pretrained(target_dir, max_seq_len=64, max_verify_rows=4) as target:
        assert target.config.arch == arch and target.config.vocab_size == 97
        assert _full(target.pool_stats()) and target.pool_stats()["live_sequences"] == 0
        with target.new_sequence(40) as seq:
            first = seq.prefill([1, 2, 3, 4, 5])
            assert 0 <= first < 97
            info = seq.info()
            assert (info["budget_tokens"], info["length"], info["steps"]) == (40, 5, 1)
            accepted, nxt = seq.verify([first, 3, 4, 5])
            assert 0 <= accepted <= 3 and 0 <= nxt < 97
            assert seq.info()["length"] == 5 + accepted + 1
            seq.rollback(accepted + 1)
            assert seq.info()["length"] == 5
            seq.reset()
            assert seq.info()["length"] == 0 and _full(target.pool_stats())
            assert seq.prefill(np.array([1, 2, 3, 4, 5], dtype=np.int64)) == first  # numpy ids, same answer
            with pytest.raises(DflashError) as e:
                seq.prefill([96, 97])
            assert e.value.status_name == "DFLASH_STATUS_OUT_OF_RANGE" and "97" in e.value.message
            with pytest.raises(DflashError):
                seq.rollback(1000)
            assert seq.info()["length"] == 5  # failed calls left the sequence as it was
            with pytest.raises(ValueError, match="int32"):
                seq.prefill([2**40])
            with pytest.raises(TypeError):
                seq.prefill([1.5])
            with pytest.raises(TypeError):
                seq.prefill("abc")
            with pytest.raises(TypeError, match="drafter Sequence"):
                seq.prefill([1], capture=object())
            with pytest.raises(TypeError, match="SamplingParams"):
                seq.verify([1], sampling={"temperature": 1.0})
        assert seq.closed and _full(target.pool_stats())
        seq.close()  # idempotent
        with pytest.raises(ValueError, match="closed"):
            seq.info()
        kept = target.new_sequence()
        assert kept.info()["budget_tokens"] == 64  # None: max_seq_len
    assert target.closed and kept.closed  # closing the target closed its sequences
    with pytest.raises(ValueError, match="target was closed"):
        kept.prefill([1])
    with pytest.raises(ValueError, match="target is closed"):
        target.pool_stats()
    target.close()  # idempotent


def test_target_from_pretrained_errors(library, make_pair, tmp_path):
    from pydflash import CheckpointError, DflashError, Target, load_tensors

    target_dir, _ = make_pair(22, vocab_size=97)
    with pytest.raises(ValueError, match="backend"):
        Target.from_pretrained(target_dir, backend="tpu")
    with pytest.raises(OSError):
        Target.from_pretrained(tmp_path / "missing")
    with pytest.raises(DflashError):
        Target.from_pretrained(target_dir, max_batch=0)
    if not library.lib.dflash_backend_compiled(library.lib.DFLASH_BACKEND_CUDA):
        with pytest.raises(DflashError):
            Target.from_pretrained(target_dir, backend="cuda")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((Path(target_dir) / "config.json").read_text())
    tensors = {n: t.array for n, t in load_tensors(target_dir).items()}
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    tensors["model.extra.weight"] = tensors["model.layers.0.input_layernorm.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = tensors["model.layers.0.self_attn.q_norm.weight"]
    make_checkpoint.write_safetensors(str(broken / "model.safetensors"),
                                      {n: _bf16_to_f32(a) for n, a in tensors.items()}, "bfloat16")
    with pytest.raises(CheckpointError) as e:
        Target.from_pretrained(broken)
    message = str(e.value)
    for words in ("unexpected", "extra.weight", "missing", "layers.1.mlp.up_proj.weight", "misshaped",
                  "norm.weight [63] (expected [64])"):
        assert words in message, message
    assert "inv_freq" not in message  # a buffer transformers skips too


def _bf16_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def test_drafter_shares_target(library, make_pair):
    from pydflash import DflashError, Drafter, Target

    target_dir, draft_dir = make_pair(23, vocab_size=97, block_size=5)
    other_hidden, _ = make_pair(24, hidden_size=32, vocab_size=97)
    other_vocab, _ = make_pair(25, vocab_size=98)
    few_layers, _ = make_pair(26, vocab_size=97, target_num_layers=1)
    with Target.from_pretrained(target_dir, max_seq_len=64) as target:
        with pytest.raises(ValueError, match="exactly one"):
            Drafter.from_pretrained(draft_dir)
        with pytest.raises(ValueError, match="exactly one"):
            Drafter.from_pretrained(draft_dir, target_dir, target=target)
        with pytest.raises(TypeError, match="Target"):
            Drafter.from_pretrained(draft_dir, target=target_dir)
        with pytest.raises(ValueError, match="backend"):
            Drafter.from_pretrained(draft_dir, target=target, backend="cuda")
        with pytest.raises(ValueError, match="stream"):
            Drafter.from_pretrained(draft_dir, target=target, stream=1)
        with Drafter.from_pretrained(draft_dir, target=target, max_seq_len=64) as drafter:
            assert drafter.target is target and drafter.backend == "host" and drafter.block_size == 5
            with drafter.new_sequence(32) as dseq, target.new_sequence(32) as tseq:
                first = tseq.prefill([3, 1, 4, 1, 5], capture=dseq)
                assert dseq.info()["next_position"] == 5
                drafts = dseq.propose(first, 5, 4)
                assert len(drafts) == 4
                accepted, _ = tseq.verify([first, *drafts], drafter_seq=dseq)
                dseq.after_verify(accepted)
                assert dseq.info()["context_rows"] == 5 + accepted + 1
                sampled = dseq.propose(first, 5 + accepted + 1, 2,
                                       SamplingParams(temperature=1.0, seed=3, draft_mode="sample"))
                assert len(sampled) == 2 and all(0 <= t < 97 for t in sampled)
                dseq.after_verify(0)
            assert _full(drafter.pool_stats()) and _full(target.pool_stats())

        for other, words in ((other_hidden, "hidden_size"), (other_vocab, "vocab_size")):
            with Target.from_pretrained(other, max_seq_len=64) as mismatched:
                with pytest.raises(ValueError, match=words):
                    Drafter.from_pretrained(draft_dir, target=mismatched)
        with Target.from_pretrained(few_layers, max_seq_len=64) as shallow:
            with pytest.raises(ValueError, match="target_layer_ids"):
                Drafter.from_pretrained(draft_dir, target=shallow)

    # The drafter keeps the shared weights alive after its target is closed.
    target = Target.from_pretrained(target_dir, max_seq_len=64)
    drafter = Drafter.from_pretrained(draft_dir, target=target, max_seq_len=64)
    target.close()
    with drafter.new_sequence(16) as dseq:
        dseq.append_context(np.zeros((3, drafter.feature_width), dtype=np.float32))
        assert len(dseq.propose(7, 3, 4)) == 4
        dseq.after_verify(0)
    drafter.close()
    with Target.from_pretrained(target_dir) as target, pytest.raises(DflashError):
        Drafter.from_pretrained(draft_dir, target=target, max_batch=0)


# --------------------------------------------------------------------------------------------------------------
# generate(): arguments and bookkeeping (losslessness is tested in test_generate_lossless.py)
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(library, tmp_path_factory):
    from pydflash import Drafter, Target

    root = tmp_path_factory.mktemp("generate_api")
    target_dir = make_checkpoint.make_target(str(root / "t"), vocab_size=61, max_position_embeddings=128, seed=31)
    draft_dir = make_checkpoint.make_drafter(str(root / "d"), target_dir=target_dir, block_size=6, seed=32)
    target = Target.from_pretrained(target_dir, max_seq_len=100, max_verify_rows=8)
    drafter = Drafter.from_pretrained(draft_dir, target=target, max_seq_len=100)
    yield target, drafter
    drafter.close()
    target.close()


def _pools_full(target, drafter):
    return _full(target.pool_stats()) and _full(drafter.pool_stats()) and \
        target.pool_stats()["live_sequences"] == 0 and drafter.pool_stats()["live_sequences"] == 0


def test_generate_result(pair):
    from pydflash import GenerationResult, generate

    target, drafter = pair
    prompt = [5, 9, 2, 33]
    ar = generate(target, None, prompt, 20)
    spec = generate(target, drafter, prompt, 20)
    assert isinstance(spec, GenerationResult)
    assert spec.output_ids == ar.output_ids and len(ar.output_ids) == 20
    assert spec.prompt_ids == prompt and spec.block_size == 6 and ar.block_size == 1
    assert sum(spec.acceptance_lengths) == 19 and len(spec.drafts) == spec.num_steps == len(spec.acceptance_lengths)
    assert all(len(d) == min(5, 20 + 4 - start - 1) for d, start in
               zip(spec.drafts, np.cumsum([4] + spec.acceptance_lengths[:-1])))
    assert ar.acceptance_lengths == [1] * 19 and ar.drafts == [[]] * 19
    assert spec.mean_acceptance_length == pytest.approx(19 / spec.num_steps)
    assert spec.tokens_per_second > 0 and spec.time_to_first_token > 0 and spec.seed is None
    assert json.loads(json.dumps(spec.to_dict()))["output_ids"] == spec.output_ids
    assert generate(target, drafter, prompt, 20, block_size=3).output_ids == ar.output_ids
    assert generate(target, drafter, prompt, 20, block_size=1).drafts == [[]] * 19
    assert _pools_full(target, drafter)


def test_generate_edges_follow_the_reference(pair):
    """max_new_tokens 0 and 1, and a stop token as the very first token, as dflash_generate truncates them."""
    from pydflash import generate

    target, drafter = pair
    prompt = [7, 7, 1]
    full = generate(target, drafter, prompt, 12)
    assert generate(target, drafter, prompt, 0).output_ids == []
    one = generate(target, drafter, prompt, 1)
    assert one.output_ids == full.output_ids[:1] and one.num_steps == 0
    first = generate(target, drafter, prompt, 12, stop_token_ids=[full.output_ids[0]])
    assert first.output_ids == full.output_ids[:1] and first.stopped and first.num_steps == 0
    # A stop token later on: output ends with it, included.
    later = full.output_ids[5]
    cut = full.output_ids.index(later) + 1
    stopped = generate(target, drafter, prompt, 12, stop_token_ids=[later, 60])
    assert stopped.output_ids == full.output_ids[:cut] and stopped.stopped
    assert sum(stopped.acceptance_lengths) == cut - 1
    assert generate(target, drafter, prompt, 12, stop_token_ids=[]).output_ids == full.output_ids
    assert _pools_full(target, drafter)


def test_generate_sampling_records_seed(pair):
    from pydflash import generate

    target, drafter = pair
    a = generate(target, drafter, [1, 2, 3], 10, temperature=1.0, seed=11)
    b = generate(target, drafter, [1, 2, 3], 10, temperature=1.0, seed=11)
    assert a.output_ids == b.output_ids and a.seed == 11  # reproducible from the seed
    c = generate(target, drafter, [1, 2, 3], 10, temperature=1.0, top_k=5, draft_mode="sample")
    assert isinstance(c.seed, int) and len(c.output_ids) == 10
    assert _pools_full(target, drafter)


def test_generate_argument_errors(pair, make_pair):
    from pydflash import Drafter, generate

    target, drafter = pair
    cases = [
        (dict(prompt_ids=[]), ValueError, "empty"),
        (dict(prompt_ids=[1, 61]), ValueError, "61 at index 1"),
        (dict(prompt_ids=[-1]), ValueError, "outside the vocabulary"),
        (dict(prompt_ids=[1.0]), TypeError, "ints"),
        (dict(prompt_ids="hello"), TypeError, "tokenizer"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(block_size=7), ValueError, "block_size 7 > the drafter's block_size 6"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(drafter=None, block_size=2), ValueError, "needs a drafter"),
        (dict(max_new_tokens=98), ValueError, "= 101 exceeds the target.s max_seq_len 100"),
        (dict(prompt_ids=[1] * 129), ValueError, "longer than the target's max_position_embeddings 128"),
        (dict(temperature=-1.0), ValueError, "non-negative"),
        (dict(draft_mode="beam"), ValueError, "draft_mode"),
    ]
    for overrides, error, words in cases:
        kw = {"target": target, "drafter": drafter, "prompt_ids": [1, 2, 3], "max_new_tokens": 4, **overrides}
        with pytest.raises(error, match=words):
            generate(**kw)
    assert _pools_full(target, drafter)

    target_dir, draft_dir = make_pair(27, vocab_size=61)
    with Drafter.from_pretrained(draft_dir, target_dir) as standalone:
        with pytest.raises(ValueError, match="target=target"):
            generate(target, standalone, [1, 2], 4)


class _FailingDrafter:
    """An external drafter whose propose fails at the third step."""

    block_size = 4

    def __init__(self):
        self.closed = 0

    def new_sequence(self):
        outer, calls = self, [0]

        class Seq:
            def propose(self, last_token, position, num_drafts, sampling=None):
                calls[0] += 1
                if calls[0] == 3:
                    raise RuntimeError("drafter broke")
                return [1] * num_drafts

            def after_verify(self, n):
                pass

            def close(self):
                outer.closed += 1

        return Seq()


def test_generate_frees_everything_on_error(pair):
    from pydflash import generate

    target, drafter = pair
    failing = _FailingDrafter()
    with pytest.raises(RuntimeError, match="drafter broke"):
        generate(target, failing, [1, 2, 3], 30)
    assert failing.closed == 1 and _pools_full(target, drafter)
    # External drafters: verified with a one-hot proposal, the output is still the target's own.
    ar = generate(target, None, [1, 2, 3], 15)

    class Echo:
        block_size = 3

        def new_sequence(self):
            class Seq:
                def propose(self, last_token, position, num_drafts, sampling=None):
                    return [last_token] * num_drafts

                def after_verify(self, n):
                    pass

                def close(self):
                    pass

            return Seq()

    assert generate(target, Echo(), [1, 2, 3], 15).output_ids == ar.output_ids
    with pytest.raises(ValueError, match="block_size 4 > the drafter's block_size 3"):
        generate(target, Echo(), [1, 2, 3], 15, block_size=4)
    assert _pools_full(target, drafter)


def test_from_tensors_equals_from_pretrained(library, make_pair):
    """Weights handed over in memory (numpy f32 arrays, or Tensors as loaded) give the same engine as the files."""
    import json

    import numpy as np

    from pydflash import CheckpointError, Drafter, Target, generate, load_tensors

    target_dir, draft_dir = make_pair(31, vocab_size=89, block_size=6)
    target_cfg = json.load(open(f"{target_dir}/config.json"))
    draft_cfg = json.load(open(f"{draft_dir}/config.json"))
    target_tensors = load_tensors(target_dir)  # names as stored ("model." prefixes)
    as_f32 = {name: t.array.astype(np.float32) if t.dtype != "BF16" else t for name, t in target_tensors.items()}
    prompt = [5, 7, 11, 13, 17, 19]
    with Target.from_pretrained(target_dir, max_seq_len=96) as t1, \
            Drafter.from_pretrained(draft_dir, target=t1, max_seq_len=96) as d1:
        expected = generate(t1, d1, prompt, max_new_tokens=24)
    with Target.from_tensors(target_cfg, as_f32, max_seq_len=96) as t2, \
            Drafter.from_tensors(draft_cfg, load_tensors(draft_dir), target=t2, max_seq_len=96) as d2:
        got = generate(t2, d2, prompt, max_new_tokens=24)
        assert t2.path == "<memory>"
    assert got.output_ids == expected.output_ids and got.drafts == expected.drafts

    # standalone drafter: embed_tokens / lm_head come with the tensors, the target's config says their shapes
    shared = {"embed_tokens.weight": target_tensors["model.embed_tokens.weight"],
              "lm_head.weight": target_tensors.get("lm_head.weight", target_tensors["model.embed_tokens.weight"])}
    with Drafter.from_pretrained(draft_dir, target_dir, max_seq_len=96) as d3, \
            Drafter.from_tensors(draft_cfg, {**load_tensors(draft_dir), **shared}, target_config=target_cfg,
                                 max_seq_len=96) as d4:
        feats = np.random.default_rng(0).standard_normal((5, d3.feature_width)).astype(np.float32)
        outs = []
        for d in (d3, d4):
            with d.new_sequence() as seq:
                seq.append_context(feats)
                outs.append(seq.propose(3, 5, 5))
        assert outs[0] == outs[1]

    missing = dict(as_f32)
    missing.pop("model.norm.weight")
    missing["model.bogus.weight"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError, match=r"unexpected in tensors: bogus.weight.*missing from tensors: norm.weight"):
        Target.from_tensors(target_cfg, missing)
    with pytest.raises(TypeError, match="int64"):
        Target.from_tensors(target_cfg, {**as_f32, "model.norm.weight": np.zeros(4, np.int64)})
    with pytest.raises(ValueError, match="exactly one"):
        Drafter.from_tensors(draft_cfg, load_tensors(draft_dir))
    with pytest.raises(CheckpointError, match="missing from tensors: embed_tokens.weight, lm_head.weight"):
        Drafter.from_tensors(draft_cfg, load_tensors(draft_dir), target_config=target_cfg)
