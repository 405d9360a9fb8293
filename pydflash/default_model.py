"""The embedded default model: a small Qwen3 target + DFlash drafter pair (HF layout) that `pydflash generate` and
`pydflash bench` use when no --target/--draft is given.

The target is byte-level (ids 0..255 are UTF-8 bytes, 256 is EOS, 257 the drafter's mask), so text goes in and
out without a tokenizer file. Two sources, one layout:

- the TRAINED pair shipped as package data in pydflash/models/default/{target,draft}/ with prompts.json (held-out
  prompts for `pydflash bench`), made by tools/train_default.sh (tools/README.md says how); its drafts are
  accepted, so it shows the speedup;
- when those files are absent (a checkout without them), a RANDOM pair drawn deterministically with numpy here:
  it exercises the whole engine (prefill, capture, propose, verify, rollback) but drafts are rarely accepted.

Either is materialised once in $XDG_CACHE_HOME/pydflash/<VERSION> (~/.cache when unset) through a temporary
directory renamed into place, so neither an interrupted run nor two concurrent first runs leave a half-written
checkpoint behind. VERSION names the content: the random pair keeps "default-v1"; the trained one is
TRAINED_VERSION, bumped whenever the shipped files change (a cached copy that no longer matches the shipped files
in size or config is replaced anyway).

Pure numpy and the standard library: the wheel carries no tools/ directory and the CLI must run offline.
"""

import json
import os
import shutil
import struct
import tempfile
import uuid
from pathlib import Path

import numpy as np

RANDOM_VERSION = "default-v1"  # the generated random pair; bump whenever the generator below changes
TRAINED_VERSION = "default-v2"  # the shipped trained pair; bump whenever pydflash/models/default changes
SHIPPED_DIR = Path(__file__).resolve().parent / "models" / "default"
_SHIPPED_FILES = ("target/config.json", "target/model.safetensors", "draft/config.json", "draft/model.safetensors",
                  "prompts.json")
EOS_TOKEN_ID, MASK_TOKEN_ID = 256, 257
TARGET = {"vocab_size": 258, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256}
DRAFT = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "intermediate_size": 256, "block_size": 8, "target_layer_ids": [1, 2]}


def shipped_pair_present():
    """True when the package carries the trained pair (pydflash/models/default, every file)."""
    return all((SHIPPED_DIR / name).is_file() for name in _SHIPPED_FILES)


VERSION = TRAINED_VERSION if shipped_pair_present() else RANDOM_VERSION  # caches are keyed by it


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pydflash" / VERSION


def default_prompts():
    """The shipped pair's held-out prompts (list of str), or None with the random pair."""
    if not shipped_pair_present():
        return None
    with open(SHIPPED_DIR / "prompts.json", encoding="utf-8") as f:
        return list(json.load(f)["prompts"])


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


def _complete(root):
    if not ((root / "target" / "model.safetensors").is_file() and (root / "draft" / "model.safetensors").is_file()):
        return False
    return not shipped_pair_present() or _matches_shipped(root)


def _matches_shipped(root):
    """A cheap identity check of a cached copy: every shipped file there, configs and prompts byte-equal, the
    weights of equal size."""
    for name in _SHIPPED_FILES:
        ours, theirs = root / name, SHIPPED_DIR / name
        if not ours.is_file():
            return False
        if name.endswith(".json"):
            if ours.read_bytes() != theirs.read_bytes():
                return False
        elif ours.stat().st_size != theirs.stat().st_size:
            return False
    return True


def ensure_default_model(root=None):
    """(target_dir, draft_dir) of the default pair, writing them first if absent (root: default cache_dir()):
    a copy of the shipped trained pair when the package has one, else the generated random pair."""
    root = Path(root) if root else cache_dir()
    if _complete(root):
        return root / "target", root / "draft"
    root.parent.mkdir(parents=True, exist_ok=True)
    if shipped_pair_present() and (root / "prompts.json").is_file() and (root / "target" / "config.json").is_file():
        # a copy of an earlier shipped pair (nothing else: never delete what we did not write): move it aside
        stale = root.parent / f"{root.name}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(root, stale)
        except OSError:
            pass  # another process moved it first
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    try:
        if shipped_pair_present():
            _copy_shipped(tmp)
        else:
            _write_pair(tmp)
        os.rename(tmp, root)  # atomic: readers see no directory or a complete one
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _complete(root):  # not another process winning the race: something is in the way
            raise OSError(f"cannot create the default model in {root}; if a partial directory is there, delete "
                          f"it") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root / "target", root / "draft"


def _copy_shipped(tmp):
    for name in _SHIPPED_FILES:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SHIPPED_DIR / name, tmp / name)


def _write_pair(tmp):
    t, d, hidden, vocab = TARGET, DRAFT, TARGET["hidden_size"], TARGET["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(t["num_hidden_layers"]):
        shapes.update(_layer_shapes(f"model.layers.{i}.", hidden, t))
    _write(tmp / "target", {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **t,
                            "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                            "max_position_embeddings": 4096, "hidden_act": "silu", "bos_token_id": None,
                            "eos_token_id": EOS_TOKEN_ID}, shapes, seed=0)
    ids = d["target_layer_ids"]
    shapes = {"fc.weight": (hidden, len(ids) * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(d["num_hidden_layers"]):
        shapes.update(_layer_shapes(f"layers.{i}.", hidden, d))
    _write(tmp / "draft", {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                           **{k: v for k, v in d.items() if k not in ("block_size", "target_layer_ids")},
                           "hidden_size": hidden, "vocab_size": vocab, "num_target_layers": t["num_hidden_layers"],
                           "block_size": d["block_size"],
                           "dflash_config": {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": ids},
                           "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
                           "hidden_act": "silu", "tie_word_embeddings": False}, shapes, seed=1)
