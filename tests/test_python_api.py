"""pydflash's pure-Python parts: config parsing (against transformers' Qwen3Config), the checkpoint loader, the
header filter, argument checks. The last group drives the real library and is skipped when it cannot be loaded
(set DFLASH_LIBRARY to a built libdflash.so)."""

import json
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

import make_checkpoint
from pydflash import _ffi
from pydflash.checkpoint import CheckpointError, load_tensors
from pydflash.config import DrafterConfig, TargetInfo, build_target_layer_ids
from pydflash.devices import cuda_devices, stream_handle
from pydflash.drafter import _feature_dtype, _gather_tensors

BASE = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 96, "vocab_size": 300, "num_target_layers": 8,
        "dflash_config": {"mask_token_id": 299, "target_layer_ids": [1, 5]}}


def cfg(**kw):
    out = json.loads(json.dumps(BASE))
    out.update(kw)
    return out


# --------------------------------------------------------------------------------------------------------------
# config.py against transformers
# --------------------------------------------------------------------------------------------------------------

CASES = {
    "plain": cfg(),
    "defaults": {"dflash_config": {"mask_token_id": 5}, "num_target_layers": 36},  # every Qwen3Config default
    "kv_null": cfg(num_key_value_heads=None),
    "kv_absent": {k: v for k, v in cfg(num_attention_heads=32, hidden_size=128).items()
                  if k != "num_key_value_heads"},
    "legacy_yarn_type": cfg(rope_theta=1e6, max_position_embeddings=131072,
                            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "legacy_yarn_full": cfg(rope_theta=5e5, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
        "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 0.5, "truncate": False}),
    "legacy_yarn_no_original": cfg(max_position_embeddings=8192, rope_scaling={"rope_type": "yarn", "factor": 2.0}),
    "legacy_default_scaling": cfg(rope_theta=20000.0, rope_scaling={"rope_type": "default"}),
    "rope_parameters_default": cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "rope_parameters_yarn": cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                 "original_max_position_embeddings": 8192,
                                                 "attention_factor": 1.25}),
    "rope_parameters_no_theta": cfg(rope_theta=3e5, rope_parameters={"rope_type": "default"}),
    "rope_scaling_wins": cfg(rope_parameters={"rope_type": "default", "rope_theta": 7.0},
                             rope_scaling={"rope_type": "yarn", "factor": 2.0}, rope_theta=9e4),
    "llama3": cfg(rope_theta=5e5, max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "layer_types_given": cfg(layer_types=["full_attention", "sliding_attention", "full_attention",
                                          "sliding_attention"], use_sliding_window=True, sliding_window=7),
    "layer_types_given_no_window": cfg(layer_types=["sliding_attention"] * 4),
    "sliding_true": cfg(use_sliding_window=True, sliding_window=32, max_window_layers=2),
    "sliding_true_default_window": cfg(use_sliding_window=True, max_window_layers=1),
    "sliding_false": cfg(use_sliding_window=False, sliding_window=32, max_window_layers=2),
    "causal_true": cfg(is_causal=True),
    "causal_false": cfg(is_causal=False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_matches_qwen3config(name):
    transformers = pytest.importorskip("transformers")
    raw = CASES[name]
    ours = DrafterConfig.from_json(raw)
    ref = transformers.Qwen3Config.from_dict(json.loads(json.dumps(raw)))
    assert ours.num_layers == ref.num_hidden_layers
    assert ours.hidden_size == ref.hidden_size
    assert ours.intermediate_size == ref.intermediate_size
    assert ours.num_heads == ref.num_attention_heads
    assert ours.num_kv_heads == ref.num_key_value_heads
    # What dflash.model's attention uses: getattr(config, "head_dim", hidden // heads).
    assert ours.head_dim == getattr(ref, "head_dim", ref.hidden_size // ref.num_attention_heads)
    assert ours.vocab_size == ref.vocab_size
    assert ours.rms_norm_eps == ref.rms_norm_eps
    assert ours.max_position_embeddings == ref.max_position_embeddings
    assert ours.sliding_window == ref.sliding_window
    assert list(ours.layer_types) == list(ref.layer_types)
    assert ours.is_causal == getattr(ref, "is_causal", None)

    rp = ref.rope_parameters
    assert ours.rope.type == rp["rope_type"]
    assert ours.rope.theta == rp["rope_theta"]
    if rp["rope_type"] in ("yarn", "llama3"):
        assert ours.rope.factor == rp["factor"]
        assert ours.rope.original_max_position == rp["original_max_position_embeddings"]
    if rp["rope_type"] == "yarn":
        assert ours.rope.beta_fast == (rp.get("beta_fast") or 32)
        assert ours.rope.beta_slow == (rp.get("beta_slow") or 1)
        assert ours.rope.attention_factor == (rp.get("attention_factor") or 0.0)
        assert ours.rope.mscale == (rp.get("mscale") or 0.0)
        assert ours.rope.mscale_all_dim == (rp.get("mscale_all_dim") or 0.0)
        assert ours.rope.truncate == rp.get("truncate", True)
    if rp["rope_type"] == "llama3":
        assert ours.rope.low_freq_factor == rp["low_freq_factor"]
        assert ours.rope.high_freq_factor == rp["high_freq_factor"]


def test_config_from_checkpoint_dir_matches_from_pretrained(make_pair):
    transformers = pytest.importorskip("transformers")
    _, draft_dir = make_pair(3, block_size=8, rope_style="parameters", rope_theta=5e4,
                             rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048},
                             max_position_embeddings=4096)
    ours = DrafterConfig.from_json(draft_dir)
    ref = transformers.Qwen3Config.from_pretrained(draft_dir)
    assert (ours.rope.type, ours.rope.theta, ours.rope.factor) == ("yarn", 5e4, 2.0)
    assert ours.rope.original_max_position == ref.rope_parameters["original_max_position_embeddings"]
    assert ours.block_size == 8 and list(ours.layer_types) == list(ref.layer_types)


def test_draft_values_follow_dflash_model():
    """dflash_config wins over the root (dflash.model._draft_value); defaults as dflash.model gives them."""
    c = DrafterConfig.from_json(cfg(block_size=4, mask_token_id=1, output_multiplier=3.0,
                                    dflash_config={"mask_token_id": 7, "block_size": 12,
                                                   "input_embedding_scale": 2.5, "final_logit_softcapping": 30}))
    assert (c.block_size, c.mask_token_id, c.output_multiplier) == (12, 7, 3.0)
    assert (c.input_embedding_scale, c.final_logit_softcapping) == (2.5, 30.0)
    assert c.target_layer_ids == tuple(build_target_layer_ids(8, 4)) == (1, 2, 4, 5)  # no ids: the default
    d = DrafterConfig.from_json({**cfg(), "dflash_config": {"mask_token_id": 3}, "num_target_layers": 36})
    assert d.target_layer_ids == tuple(build_target_layer_ids(36, 4)) == (1, 12, 22, 33)
    assert (d.block_size, d.input_embedding_scale, d.output_multiplier, d.final_logit_softcapping) == (16, 1, 1, 0)
    assert DrafterConfig.from_json(cfg(final_logit_softcapping=-1.0)).final_logit_softcapping == 0.0
    assert DrafterConfig.from_json({**cfg(), "dflash_config": None, "mask_token_id": 2,
                                    "target_layer_ids": [0]}).target_layer_ids == (0,)


def test_build_target_layer_ids_matches_reference():
    dfm = pytest.importorskip("dflash.model")
    for n_target in (4, 5, 8, 28, 36, 64):
        for n_draft in range(1, 9):
            assert build_target_layer_ids(n_target, n_draft) == dfm.build_target_layer_ids(n_target, n_draft)


@pytest.mark.parametrize("raw, words", [
    (cfg(attention_bias=True), "attention_bias is not supported"),
    (cfg(hidden_act="gelu"), "hidden_act"),
    (cfg(rope_scaling={"rope_type": "longrope", "short_factor": [1], "long_factor": [1]}), "longrope"),
    (cfg(rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic"),
    (cfg(rope_scaling={"rope_type": "linear", "factor": 2.0}), "linear"),
    (cfg(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (cfg(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (cfg(rope_parameters={"full_attention": {"rope_type": "default"}}), "per-layer"),
    (cfg(rope_scaling={"rope_type": "yarn"}), "factor"),
    (cfg(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (cfg(rope_scaling={"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.0}), "attention_factor"),
    (cfg(layer_types=["full_attention"] * 3), "layer_types"),
    (cfg(layer_types=["full_attention", "linear_attention", "full_attention", "full_attention"]), "layer_types"),
    ({**cfg(), "dflash_config": {"target_layer_ids": [1]}}, "mask_token_id"),
    ({k: v for k, v in cfg(dflash_config={"mask_token_id": 1}).items() if k != "num_target_layers"},
     "num_target_layers"),
    (cfg(dflash_config={"mask_token_id": 1, "conv_kernel_size": 4}), "DFlash2"),
])
def test_config_refuses_what_the_engine_cannot_run(raw, words):
    with pytest.raises(ValueError, match=words):
        DrafterConfig.from_json(raw)


def test_target_info_and_fit():
    t = TargetInfo.from_json({"hidden_size": 64, "vocab_size": 300, "num_hidden_layers": 8})
    assert t == TargetInfo(64, 300, 8, False)
    nested = TargetInfo.from_json({"text_config": {"hidden_size": 64, "vocab_size": 300, "num_hidden_layers": 8},
                                   "tie_word_embeddings": True})
    assert nested.tie_word_embeddings and nested.hidden_size == 64
    with pytest.raises(ValueError, match="vocab_size"):
        TargetInfo.from_json({"hidden_size": 64, "num_hidden_layers": 8})
    c = DrafterConfig.from_json(cfg())
    c.check_target(t)
    with pytest.raises(ValueError) as e:
        c.check_target(TargetInfo(32, 301, 5, False))
    assert all(w in str(e.value) for w in ("hidden_size 32", "vocab_size 301", "[5]"))


# --------------------------------------------------------------------------------------------------------------
# checkpoint.py
# --------------------------------------------------------------------------------------------------------------

def _write(path, entries, pad=True):
    """entries: {name: (dtype string, shape, raw bytes)} -> a .safetensors file written by hand."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, blob) in entries.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    if pad:
        head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _index(directory, weight_map):
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_load_single_file_keeps_dtypes_zero_copy(tmp_path):
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3)
    f16 = np.array([1.5, -2.0], dtype=np.float16)
    bf16 = make_checkpoint.float32_to_bf16_bits(np.array([[1.0, -0.5], [3.0, 0.25]], np.float32))
    _write(tmp_path / "model.safetensors", {"a": ("F32", f32.shape, f32.tobytes()),
                                            "b": ("F16", f16.shape, f16.tobytes()),
                                            "c": ("BF16", bf16.shape, bf16.tobytes())})
    t = load_tensors(tmp_path)
    assert {n: (x.dtype, x.shape) for n, x in t.items()} == {"a": ("F32", (2, 3)), "b": ("F16", (2,)),
                                                             "c": ("BF16", (2, 2))}
    np.testing.assert_array_equal(t["a"].array, f32)
    np.testing.assert_array_equal(t["b"].array, f16)
    assert t["c"].array.dtype == np.uint16 and (t["c"].array == bf16).all()
    for x in t.values():
        assert not x.array.flags.writeable  # a view of the read-only map, not a copy
        assert isinstance(x.array, np.memmap)


def test_load_sharded_and_subset(tmp_path):
    make_checkpoint.make_target(str(tmp_path / "one"), num_layers=2, seed=4)
    make_checkpoint.make_target(str(tmp_path / "three"), num_layers=2, seed=4, shards=3)
    one, three = load_tensors(tmp_path / "one"), load_tensors(tmp_path / "three")
    assert one.keys() == three.keys()
    for name in one:
        assert (one[name].array == three[name].array).all()
    assert len({t.file for t in three.values()}) == 3
    subset = load_tensors(tmp_path / "three", names=["lm_head.weight", "nope"])
    assert list(subset) == ["lm_head.weight"]


def test_subset_opens_only_the_shards_it_needs(tmp_path):
    make_checkpoint.make_target(str(tmp_path), num_layers=2, shards=3)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    other = sorted(set(weight_map.values()) - {weight_map["lm_head.weight"]})[0]
    (tmp_path / other).write_bytes(b"garbage")  # listed and present, but never opened
    assert list(load_tensors(tmp_path, names=["lm_head.weight"])) == ["lm_head.weight"]
    with pytest.raises(CheckpointError, match=other):
        load_tensors(tmp_path)


def _two_shards(tmp_path, first, second, weight_map):
    blob = np.zeros(2, np.float32).tobytes()
    _write(tmp_path / "s1.safetensors", {n: ("F32", (2,), blob) for n in first})
    _write(tmp_path / "s2.safetensors", {n: ("F32", (2,), blob) for n in second})
    _index(tmp_path, weight_map)


def test_sharded_errors(tmp_path):
    _two_shards(tmp_path, ["a", "dup"], ["b", "dup"], {"a": "s1.safetensors", "b": "s2.safetensors",
                                                       "dup": "s1.safetensors"})
    with pytest.raises(CheckpointError, match=r"'dup' is in both .*s1.safetensors and .*s2.safetensors"):
        load_tensors(tmp_path)

    _two_shards(tmp_path, ["a"], ["b"], {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s3.safetensors"})
    with pytest.raises(CheckpointError, match="s3.safetensors"):
        load_tensors(tmp_path)

    _two_shards(tmp_path, ["a"], ["b"], {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors"})
    with pytest.raises(CheckpointError, match=r"s2.safetensors: lacks c"):
        load_tensors(tmp_path)

    _two_shards(tmp_path, ["a", "x"], ["b"], {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(CheckpointError, match=r"s1.safetensors: holds x"):
        load_tensors(tmp_path)

    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="index"):
        load_tensors(tmp_path)


def test_file_errors(tmp_path):
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_tensors(tmp_path)

    _write(tmp_path / "model.safetensors", {"ids": ("I64", (2,), np.zeros(2, np.int64).tobytes())})
    with pytest.raises(CheckpointError, match=r"'ids' has dtype I64"):
        load_tensors(tmp_path)

    good = np.zeros(4, np.float32).tobytes()
    _write(tmp_path / "model.safetensors", {"w": ("F32", (4,), good)})
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-3])  # truncated
    with pytest.raises(CheckpointError, match="model.safetensors: not a valid safetensors file"):
        load_tensors(tmp_path)

    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")  # absurd header length
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_tensors(tmp_path)

    # safetensors keeps the last of duplicate keys, so this file passes its checks; the loader must not.
    head = (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            b'"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            b'"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}')
    head += b" " * (-len(head) % 8)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + bytes(8))
    with pytest.raises(CheckpointError, match="duplicate tensor names"):
        load_tensors(tmp_path)


def test_expected_tensors_one_error_lists_everything(tmp_path, make_pair):
    target_dir, draft_dir = make_pair(5, block_size=4)
    config, target = DrafterConfig.from_json(draft_dir), TargetInfo.from_json(target_dir)
    expected = config.tensor_shapes(target)
    assert set(_gather_tensors(draft_dir, target_dir, expected)) == set(expected)

    broken = tmp_path / "draft"
    shutil.copytree(draft_dir, broken)
    tensors = {n: t.array for n, t in load_tensors(draft_dir).items()}
    del tensors["layers.1.mlp.up_proj.weight"]
    tensors["layers.0.self_attn.q_norm.weight"] = tensors["layers.0.self_attn.q_norm.weight"][:-1]
    tensors["extra.weight"] = tensors["norm.weight"]
    _write(broken / "model.safetensors", {n: ("BF16", a.shape, a.tobytes()) for n, a in tensors.items()})
    with pytest.raises(CheckpointError) as e:
        _gather_tensors(broken, target_dir, expected)
    message = str(e.value)
    for words in ("unexpected", "extra.weight", "missing", "layers.1.mlp.up_proj.weight", "misshaped",
                  "layers.0.self_attn.q_norm.weight [31] (expected [32])"):
        assert words in message, message

    tied = TargetInfo(target.hidden_size, target.vocab_size, target.num_hidden_layers, True)
    assert "lm_head.weight" not in config.tensor_shapes(tied)


# --------------------------------------------------------------------------------------------------------------
# _ffi.py header filter, argument checks, devices
# --------------------------------------------------------------------------------------------------------------

def test_cdef_filter_on_a_synthetic_header():
    source, ints = _ffi.cdef_source("""
#ifndef X_H
#define X_H
#ifdef __cplusplus
extern "C" {
#endif
#if defined(BUILDING)
#define X_API __attribute__((visibility("default")))
#else
#define X_API
#endif
#define X_N 4
#define X_HEX 0x10u
typedef struct { int a[X_N]; char b[X_HEX]; } x_s;
X_API int x_f(x_s *s);
#ifdef __cplusplus
}
#endif
#endif
""")
    assert ints == {"X_N": "4", "X_HEX": "0x10"}
    assert "extern" not in source and "X_API" not in source and "}\n" not in source.split("x_s;")[1]
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(source)
    assert ffi.sizeof("x_s") == 4 * 4 + 16


def test_header_structs_match_the_c_compiler(tmp_path):
    """cffi's layout of every public struct equals the C compiler's (the ABI's whole point)."""
    ffi, _ = _ffi.make_ffi()
    structs = ["dflash_context_params", "dflash_rope_params", "dflash_drafter_params", "dflash_pool_stats",
               "dflash_seq_info"]
    assert ffi.typeof("dflash_drafter_params").fields  # parsed as a struct
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    header = _ffi._find_header()
    lines = [f'printf("%zu ", sizeof({s}));' for s in structs]
    lines += [f'printf("%zu ", offsetof({s}, {f}));' for s in structs for f, _ in ffi.typeof(s).fields]
    (tmp_path / "s.c").write_text('#include <stddef.h>\n#include <stdio.h>\n#include "dflash.h"\nint main(void){'
                                  + "".join(lines) + "return 0;}\n")
    include = os.path.dirname(header)
    subprocess.run(["cc", "-std=c99", "-I", include, "-o", str(tmp_path / "s"), str(tmp_path / "s.c")], check=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "s")], capture_output=True, text=True).stdout.split()]
    want = [ffi.sizeof(s) for s in structs]
    want += [ffi.offsetof(s, f) for s in structs for f, _ in ffi.typeof(s).fields]
    assert got == want


def test_feature_dtype_checks():
    assert _feature_dtype(np.zeros((1, 2), np.float32), None) == "DFLASH_DTYPE_F32"
    assert _feature_dtype(np.zeros((1, 2), np.float16), "float16") == "DFLASH_DTYPE_F16"
    assert _feature_dtype(np.zeros((1, 2), np.uint16), "bf16") == "DFLASH_DTYPE_BF16"
    with pytest.raises(TypeError, match="ambiguous"):
        _feature_dtype(np.zeros((1, 2), np.uint16), None)
    with pytest.raises(TypeError, match="float64"):
        _feature_dtype(np.zeros((1, 2), np.float64), None)
    with pytest.raises(TypeError, match="needs an array of float32"):
        _feature_dtype(np.zeros((1, 2), np.float16), "f32")
    with pytest.raises(TypeError, match="byte order"):
        _feature_dtype(np.zeros((1, 2), ">f4"), None)
    with pytest.raises(ValueError, match="one of"):
        _feature_dtype(np.zeros((1, 2), np.float32), "fp8")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert _feature_dtype(np.zeros((1, 2), ml_dtypes.bfloat16), None) == "DFLASH_DTYPE_BF16"


def test_devices_never_raise():
    assert isinstance(cuda_devices(), list)
    assert stream_handle(None) == 0 and stream_handle(1234) == 1234

    class TorchLike:
        cuda_stream = 77

    assert stream_handle(TorchLike()) == 77
    with pytest.raises(TypeError):
        stream_handle("stream")
    with pytest.raises(TypeError):
        stream_handle(True)
    with pytest.raises(ValueError):
        stream_handle(-1)
    runtime = pytest.importorskip("cuda.bindings.runtime")
    assert stream_handle(runtime.cudaStream_t(4321)) == 4321


# --------------------------------------------------------------------------------------------------------------
# With the library (skipped when it cannot be loaded)
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def library():
    try:
        return _ffi.load()
    except ImportError as e:
        pytest.skip(f"libdflash not loadable: {e}")


def test_lifecycle_and_argument_checks(library, make_pair):
    from pydflash import DflashError, Drafter

    target_dir, draft_dir = make_pair(7, block_size=6)
    with Drafter.from_pretrained(draft_dir, target_dir, max_batch=2, max_seq_len=64) as drafter:
        full = drafter.pool_stats()
        assert full["free_blocks"] == full["total_blocks"] and full["live_sequences"] == 0
        seq = drafter.new_sequence(40)
        width = drafter.feature_width
        rng = np.random.default_rng(0)
        for bad, error in ((rng.standard_normal((3, width)), TypeError),           # float64
                           (np.zeros((3, width + 1), np.float32), ValueError),   # width
                           (np.zeros(width, np.float32), ValueError),            # ndim
                           (np.zeros((width, 3), np.float32).T, ValueError),     # not contiguous
                           ([[0.0] * width], TypeError)):                        # not an array
            with pytest.raises(error):
                seq.append_context(bad)
        assert seq.info()["context_rows"] == 0
        seq.append_context(rng.standard_normal((5, width), dtype=np.float32))
        seq.append_context(rng.standard_normal((2, width)).astype(np.float16))
        bits = make_checkpoint.float32_to_bf16_bits(rng.standard_normal((1, width), dtype=np.float32))
        seq.append_context(bits, dtype="bf16")
        drafts = seq.propose(3, 8, 10)
        assert len(drafts) == 5 and all(0 <= t < drafter.config.vocab_size for t in drafts)
        hidden = seq.read_hidden()
        assert hidden.shape == (5, drafter.hidden_size) and np.isfinite(hidden).all()
        seq.after_verify(2)
        with pytest.raises(DflashError) as e:
            seq.propose(drafter.config.vocab_size, 8, 3)
        assert e.value.status_name.startswith("DFLASH_STATUS_") and e.value.message
        info = seq.info()
        assert (info["next_position"], info["proposals"], info["accepted_drafts"]) == (8, 1, 2)
        assert info["graph_replays"] == 0  # the host backend records no graphs
        seq.reset()
        assert seq.info()["context_rows"] == 0
        seq.close()
        seq.close()  # no-op
        with pytest.raises(ValueError, match="closed"):
            seq.propose(3, 0, 1)
        assert drafter.pool_stats() == full

        orphan = drafter.new_sequence()
        orphan.append_context(np.zeros((20, width), np.float32))
    assert drafter.closed and orphan.closed
    orphan.close()  # its drafter took it down: a no-op
    with pytest.raises(ValueError, match="drafter was closed"):
        orphan.info()
    drafter.close()


def test_from_pretrained_errors_leave_nothing_behind(library, make_pair, tmp_path):
    from pydflash import DflashError, Drafter

    target_dir, draft_dir = make_pair(7, block_size=6)
    other_target, _ = make_pair(8, hidden_size=32)
    with pytest.raises(ValueError, match="hidden_size"):
        Drafter.from_pretrained(draft_dir, other_target)
    with pytest.raises(ValueError, match="backend"):
        Drafter.from_pretrained(draft_dir, target_dir, backend="tpu")
    with pytest.raises(DflashError):
        Drafter.from_pretrained(draft_dir, target_dir, max_batch=0)
    if not library.lib.dflash_backend_compiled(library.lib.DFLASH_BACKEND_CUDA) or not cuda_devices():
        with pytest.raises(DflashError):
            Drafter.from_pretrained(draft_dir, target_dir, backend="cuda")


def test_cli(library, capsys, monkeypatch, tmp_path):
    from pydflash.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["info"]) == 0
    assert "abi:" in capsys.readouterr().out
    assert main(["demo", "--steps", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["steps"]) == 3
    assert report["pool_after_free"]["free_blocks"] == report["pool_after_free"]["total_blocks"]
    assert main(["demo", "--steps", "-1"]) == 2
    assert capsys.readouterr().err.startswith("pydflash: error:")
