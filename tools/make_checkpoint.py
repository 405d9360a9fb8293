#!/usr/bin/env python3
"""Deterministic random HF checkpoints for tests: a Qwen3 or Llama target and a DFlash drafter.

Only numpy and the standard library, so it runs where torch is absent (CI, the device machine). The safetensors
files are written by hand, which also lets BF16 go out without ml_dtypes.

    python tools/make_checkpoint.py target OUT --hidden 64 --layers 4
    python tools/make_checkpoint.py drafter OUT --target DIR --layers 2 --block-size 8

Weights: linear normal(0, 1/sqrt(fan_in)) so activations keep unit scale through depth; norms 1 + 0.1*normal so
they are not a no-op; embeddings normal(0, 1) so logits have O(1) spread and argmax ties stay rare. Tensors are
drawn from one numpy.random.default_rng(seed) in sorted-name order, so the values depend only on the seed and the
shapes, never on sharding or dtype.
"""

import argparse
import json
import math
import os
import struct

import numpy as np

_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def build_target_layer_ids(num_target_layers, num_draft_layers):
    """dflash.model.build_target_layer_ids, re-implemented (no torch here)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    # Python's round() (banker's rounding), exactly as the reference does.
    return [round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def float32_to_bf16_bits(x):
    """float32 array -> uint16 bf16 bit patterns, round-to-nearest-even like torch. NaN -> 0x7FC0 (c10's scalar
    rule; torch's vectorised CPU cast gives 0xFFFF; any NaN will do, and checkpoints hold none)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), rounded)


def _encode(array, dtype):
    """float32 array -> raw little-endian bytes of the stored dtype."""
    if dtype == "bfloat16":
        return float32_to_bf16_bits(array).astype("<u2").tobytes()
    if dtype == "float16":
        return array.astype("<f2").tobytes()
    if dtype == "float32":
        return array.astype("<f4").tobytes()
    raise ValueError(f"dtype {dtype!r} not in {sorted(_ST_DTYPES)}")


def write_safetensors(path, tensors, dtype):
    """tensors: {name: float32 ndarray}, written in sorted-name order."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        blob = _encode(tensors[name], dtype)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header with spaces so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)
    return offset


def _save_tensors(out_dir, tensors, dtype, shards):
    """model.safetensors, or model-0000k-of-0000n.safetensors + model.safetensors.index.json when shards > 1."""
    names = sorted(tensors)
    if shards <= 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, dtype)
        return
    if shards > len(names):
        raise ValueError(f"shards {shards} > {len(names)} tensors")
    weight_map, total = {}, 0
    for k, group in enumerate(np.array_split(np.array(names, dtype=object), shards)):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        total += write_safetensors(os.path.join(out_dir, fname), {n: tensors[n] for n in group}, dtype)
        weight_map.update({n: fname for n in group})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _draw(shapes, seed):
    """{name: (shape, kind)} -> {name: float32 array}; kind in linear | norm | embed."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(shapes):
        shape, kind = shapes[name]
        x = rng.standard_normal(shape, dtype=np.float32)
        if kind == "linear":
            x *= np.float32(1.0 / math.sqrt(shape[1]))
        elif kind == "norm":
            x = np.float32(1.0) + np.float32(0.1) * x
        out[name] = x
    return out


def _layer_shapes(prefix, hidden, heads, kv_heads, head_dim, inter):
    a = prefix + "self_attn."
    return {
        prefix + "input_layernorm.weight": ((hidden,), "norm"),
        prefix + "post_attention_layernorm.weight": ((hidden,), "norm"),
        a + "q_proj.weight": ((heads * head_dim, hidden), "linear"),
        a + "k_proj.weight": ((kv_heads * head_dim, hidden), "linear"),
        a + "v_proj.weight": ((kv_heads * head_dim, hidden), "linear"),
        a + "o_proj.weight": ((hidden, heads * head_dim), "linear"),
        a + "q_norm.weight": ((head_dim,), "norm"),
        a + "k_norm.weight": ((head_dim,), "norm"),
        prefix + "mlp.gate_proj.weight": ((inter, hidden), "linear"),
        prefix + "mlp.up_proj.weight": ((inter, hidden), "linear"),
        prefix + "mlp.down_proj.weight": ((hidden, inter), "linear"),
    }


def _write_config(out_dir, config):
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


_TARGET_ARCHS = ("qwen3", "llama")


def make_target(out_dir, *, vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                head_dim=32, intermediate_size=128, tie_word_embeddings=False, rope_theta=10000.0,
                rms_norm_eps=1e-6, max_position_embeddings=4096, seed=0, dtype="bfloat16", shards=1,
                eos_token_id=None, arch="qwen3", rope_scaling=None):
    """Write a random Qwen3ForCausalLM (arch "qwen3") or LlamaForCausalLM (arch "llama": no q_norm/k_norm)
    checkpoint to out_dir; returns out_dir.

    rope_scaling: the legacy root dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}; None = plain RoPE.
    """
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {sorted(_ST_DTYPES)}")
    if arch not in _TARGET_ARCHS:
        raise ValueError(f"arch {arch!r} not in {list(_TARGET_ARCHS)}")
    os.makedirs(out_dir, exist_ok=True)
    if arch == "llama":
        _write_config(out_dir, {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "pretraining_tp": 1,
            "max_position_embeddings": max_position_embeddings,
            "rms_norm_eps": rms_norm_eps,
            "rope_theta": rope_theta,
            "rope_scaling": dict(rope_scaling) if rope_scaling else None,
            "tie_word_embeddings": tie_word_embeddings,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": None,
            "eos_token_id": eos_token_id,
            "dtype": dtype,
        })
        return _write_target_tensors(out_dir, arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                                     head_dim, intermediate_size, tie_word_embeddings, seed, dtype, shards)
    _write_config(out_dir, {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": dict(rope_scaling) if rope_scaling else None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "tie_word_embeddings": tie_word_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "dtype": dtype,
    })
    return _write_target_tensors(out_dir, arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                                 head_dim, intermediate_size, tie_word_embeddings, seed, dtype, shards)


def _write_target_tensors(out_dir, arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
                          intermediate_size, tie_word_embeddings, seed, dtype, shards):
    shapes = {"model.embed_tokens.weight": ((vocab_size, hidden_size), "embed"),
              "model.norm.weight": ((hidden_size,), "norm")}
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = ((vocab_size, hidden_size), "linear")
    for i in range(num_layers):
        layer = _layer_shapes(f"model.layers.{i}.", hidden_size, num_heads, num_kv_heads, head_dim,
                              intermediate_size)
        if arch == "llama":  # Llama has no per-head q/k RMSNorm
            layer = {name: v for name, v in layer.items() if not name.endswith(("q_norm.weight", "k_norm.weight"))}
        shapes.update(layer)
    _save_tensors(out_dir, _draw(shapes, seed), dtype, shards)
    return out_dir


def make_drafter(out_dir, *, target_dir, num_layers=2, target_layer_ids=None, block_size=16, mask_token_id=None,
                 num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128, rope_theta=10000.0,
                 rope_scaling=None, rope_style="legacy", layer_types=None, sliding_window=None,
                 use_sliding_window=None, is_causal=None, input_embedding_scale=None, output_multiplier=None,
                 final_logit_softcapping=None, rms_norm_eps=1e-6, seed=1, dtype="bfloat16", shards=1):
    """Write a random DFlashDraftModel checkpoint (z-lab layout) for the target in target_dir; returns out_dir.

    rope_style "legacy": root rope_theta + rope_scaling (older z-lab configs); "parameters": transformers 5's
    rope_parameters dict (rope_type, rope_theta and the scaling keys together).
    """
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {sorted(_ST_DTYPES)}")
    if rope_style not in ("legacy", "parameters"):
        raise ValueError(f"rope_style {rope_style!r} not in ['legacy', 'parameters']")
    with open(os.path.join(target_dir, "config.json")) as f:
        tcfg = json.load(f)
    hidden, vocab, n_target = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["num_hidden_layers"]
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(n_target, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    if mask_token_id is None:
        mask_token_id = vocab - 1

    dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids}
    for key, value in (("input_embedding_scale", input_embedding_scale), ("output_multiplier", output_multiplier),
                       ("final_logit_softcapping", final_logit_softcapping)):
        if value is not None:
            dflash_config[key] = value
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": dflash_config,
        "num_target_layers": n_target,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "rms_norm_eps": rms_norm_eps,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
    }
    if rope_style == "legacy":
        config["rope_theta"] = rope_theta
        config["rope_scaling"] = dict(rope_scaling) if rope_scaling else None
    else:
        config["rope_parameters"] = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    for key, value in (("layer_types", layer_types), ("sliding_window", sliding_window),
                       ("use_sliding_window", use_sliding_window), ("is_causal", is_causal)):
        if value is not None:
            config[key] = list(value) if key == "layer_types" else value
    os.makedirs(out_dir, exist_ok=True)
    _write_config(out_dir, config)

    shapes = {"fc.weight": ((hidden, len(target_layer_ids) * hidden), "linear"),
              "hidden_norm.weight": ((hidden,), "norm"),
              "norm.weight": ((hidden,), "norm")}
    for i in range(num_layers):
        shapes.update(_layer_shapes(f"layers.{i}.", hidden, num_heads, num_kv_heads, head_dim, intermediate_size))
    _save_tensors(out_dir, _draw(shapes, seed), dtype, shards)
    return out_dir


def _int_list(text):
    return [int(x) for x in text.split(",") if x]


def _bool(text):
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
    return text.lower() in ("true", "1")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="kind", required=True)

    def common(s, layers, seed):
        s.add_argument("out")
        s.add_argument("--layers", type=int, default=layers, dest="num_layers")
        s.add_argument("--heads", type=int, default=4, dest="num_heads")
        s.add_argument("--kv-heads", type=int, default=2, dest="num_kv_heads")
        s.add_argument("--head-dim", type=int, default=32)
        s.add_argument("--intermediate", type=int, default=128, dest="intermediate_size")
        s.add_argument("--rope-theta", type=float, default=10000.0)
        s.add_argument("--rms-norm-eps", type=float, default=1e-6)
        s.add_argument("--seed", type=int, default=seed)
        s.add_argument("--dtype", choices=sorted(_ST_DTYPES), default="bfloat16")
        s.add_argument("--shards", type=int, default=1)

    t = sub.add_parser("target", help="random Qwen3ForCausalLM or LlamaForCausalLM")
    common(t, 4, 0)
    t.add_argument("--vocab", type=int, default=512, dest="vocab_size")
    t.add_argument("--hidden", type=int, default=64, dest="hidden_size")
    t.add_argument("--tie", action="store_true", dest="tie_word_embeddings")
    t.add_argument("--max-positions", type=int, default=4096, dest="max_position_embeddings")
    t.add_argument("--eos", type=int, default=None, dest="eos_token_id")
    t.add_argument("--arch", choices=list(_TARGET_ARCHS), default="qwen3")
    t.add_argument("--rope-scaling", type=json.loads, default=None,
                   help='JSON, e.g. {"rope_type":"llama3","factor":8.0,...}')

    d = sub.add_parser("drafter", help="random DFlashDraftModel for a target")
    common(d, 2, 1)
    d.add_argument("--target", required=True, dest="target_dir")
    d.add_argument("--target-layer-ids", type=_int_list, default=None)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--mask-token-id", type=int, default=None)
    d.add_argument("--rope-scaling", type=json.loads, default=None, help='JSON, e.g. {"rope_type":"yarn",...}')
    d.add_argument("--rope-style", choices=["legacy", "parameters"], default="legacy")
    d.add_argument("--layer-types", type=lambda s: s.split(","), default=None)
    d.add_argument("--sliding-window", type=int, default=None)
    d.add_argument("--use-sliding-window", type=_bool, default=None)
    d.add_argument("--is-causal", type=_bool, default=None)
    d.add_argument("--input-embedding-scale", type=float, default=None)
    d.add_argument("--output-multiplier", type=float, default=None)
    d.add_argument("--final-logit-softcapping", type=float, default=None)

    args = vars(p.parse_args(argv))
    kind, out = args.pop("kind"), args.pop("out")
    print((make_target if kind == "target" else make_drafter)(out, **args))


if __name__ == "__main__":
    main()
