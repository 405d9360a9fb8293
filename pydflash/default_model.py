"""A tiny deterministic random target + DFlash drafter pair (HF layout) for `pydflash demo`.

Pure numpy: the wheel carries no tools/ directory and the demo must run offline. Files are written once into
~/.cache/pydflash/demo-v1 (bump the version when the layout changes) through a temporary directory that is
renamed into place, so an interrupted run never leaves a half-written checkpoint behind.
"""

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

VERSION = "demo-v1"
TARGET = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}
DRAFT = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 128, "block_size": 8, "target_layer_ids": [1, 3]}


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pydflash" / VERSION


def _bf16_bits(x):
    """float32 -> bf16 bit patterns, round to nearest even (finite inputs only, which is all we draw)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2")


def _write_safetensors(path, tensors):
    header, offset = {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # keeps the data 8-byte aligned, as safetensors writers do
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name in sorted(tensors):
            f.write(tensors[name].tobytes())


def _random_weights(shapes, seed):
    """Linear weights ~ N(0, 1/fan_in) (unit-scale activations), norms ~ 1 + 0.1 N(0,1), embeddings ~ N(0,1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        x = rng.standard_normal(shape, dtype=np.float32)
        if len(shape) == 1:
            x = 1 + np.float32(0.1) * x
        elif "embed_tokens" not in name:
            x /= np.float32(np.sqrt(shape[1]))
        out[name] = _bf16_bits(x)
    return out


def _layer_shapes(prefix, hidden, cfg):
    hd, inter = cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    a, m = prefix + "self_attn.", prefix + "mlp."
    return {prefix + "input_layernorm.weight": (hidden,), prefix + "post_attention_layernorm.weight": (hidden,),
            a + "q_proj.weight": (q, hidden), a + "k_proj.weight": (kv, hidden), a + "v_proj.weight": (kv, hidden),
            a + "o_proj.weight": (hidden, q), a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,),
            m + "gate_proj.weight": (inter, hidden), m + "up_proj.weight": (inter, hidden),
            m + "down_proj.weight": (hidden, inter)}


def _write(directory, config, shapes, seed):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    _write_safetensors(directory / "model.safetensors", _random_weights(shapes, seed))


def ensure_demo_checkpoint(root=None):
    """(draft_dir, target_dir), writing them first if absent."""
    root = Path(root) if root else cache_dir()
    if not (root / "draft" / "model.safetensors").is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
        t, d, hidden, vocab = TARGET, DRAFT, TARGET["hidden_size"], TARGET["vocab_size"]
        shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                  "lm_head.weight": (vocab, hidden)}
        for i in range(t["num_hidden_layers"]):
            shapes.update(_layer_shapes(f"model.layers.{i}.", hidden, t))
        _write(tmp / "target", {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **t,
                                "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                                "max_position_embeddings": 4096, "hidden_act": "silu"}, shapes, seed=0)
        ids = d["target_layer_ids"]
        shapes = {"fc.weight": (hidden, len(ids) * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
        for i in range(d["num_hidden_layers"]):
            shapes.update(_layer_shapes(f"layers.{i}.", hidden, d))
        _write(tmp / "draft", {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                               **{k: v for k, v in d.items() if k not in ("block_size", "target_layer_ids")},
                               "hidden_size": hidden, "vocab_size": vocab, "num_target_layers": t["num_hidden_layers"],
                               "block_size": d["block_size"],
                               "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": ids},
                               "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
                               "hidden_act": "silu", "tie_word_embeddings": False}, shapes, seed=1)
        try:
            os.rename(tmp, root)
        except OSError:  # another process won the race (or a stale dir is in the way): keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
            if not (root / "draft" / "model.safetensors").is_file():
                raise
    return root / "draft", root / "target"
