"""Shared pieces of the default-model trainers (tools only: torch is never a runtime dependency of pydflash).

- the corpus: Python sources found offline (the standard library and every site-packages directory),
  de-duplicated by content hash, split into train / held-out BY FILE (a hash of the file's path), packed as bytes
  with EOS between files;
- the byte vocabulary: ids 0..255 are UTF-8 bytes, 256 is EOS, 257 the drafter's mask (pydflash.default_model);
- a Qwen3 target and a DFlash drafter written in plain torch with exactly the parameter names (and the math) of
  transformers' Qwen3ForCausalLM and `dflash.model.DFlashDraftModel`, so `state_dict()` saves straight to the HF
  layout those classes load unchanged; the drafter's forward takes many blocks of one sequence at once under an
  attention mask that gives every block exactly what the reference shows it at inference (see DrafterModel);
- greedy speculative decoding in torch (a mirror of `dflash.model.dflash_generate`) for the acceptance numbers.

Nothing here imports transformers or dflash; the self-checks (train_drafter.py --self-check) compare against them.
"""

import concurrent.futures
import hashlib
import json
import math
import os
import site
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

VOCAB_SIZE, EOS_TOKEN_ID, MASK_TOKEN_ID = 258, 256, 257
# Valid UTF-8 never holds the byte 0xFF, and the corpus keeps only files that decode as UTF-8, so 0xFF stands for
# EOS in the packed uint8 stream and becomes id 256 when batches are cut.
EOS_BYTE = 0xFF

# The run's clock: train_default.sh exports its own start time so that the budget covers interpreter start-up too.
_T0 = float(os.environ.get("TRAIN_T0") or time.time())


def log(message):
    print(f"[{time.time() - _T0:7.1f}s] {message}", flush=True)


def sha1_int(text):
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big")


# ---------------------------------------------------------------------------------------------------------------
# corpus
# ---------------------------------------------------------------------------------------------------------------

def source_roots():
    """[(prefix, dir)]: the standard library ("stdlib/") and each site-packages directory ("site/"), existing,
    de-duplicated by real path."""
    stdlib = os.path.dirname(os.__file__)
    sites = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    sites += [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if isinstance(user, str):
        sites.append(user)
    roots, seen = [], set()
    for prefix, d in [("stdlib/", stdlib)] + [("site/", s) for s in sites]:
        real = os.path.realpath(d)
        if os.path.isdir(real) and real not in seen:
            seen.add(real)
            roots.append((prefix, real))
    return roots


def _walk_sources(prefix, root, other_roots, min_bytes, max_bytes):
    """(key, path, size) of every *.py under root, skipping __pycache__, nested site-/dist-packages (their own
    roots, or not ours) and other roots nested inside this one. key = prefix + path relative to root."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        keep = []
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if d in ("__pycache__", "site-packages", "dist-packages") or d.startswith(".") or full in other_roots:
                continue
            keep.append(d)
        dirnames[:] = sorted(keep)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                size = os.stat(path).st_size
            except OSError:
                continue
            if min_bytes <= size <= max_bytes:
                out.append((prefix + os.path.relpath(path, root), path, size))
    return out


def _read_source(path, max_line):
    """The file's bytes when it is UTF-8 text without over-long lines (generated tables, minified data), else None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if EOS_BYTE in data or b"\x00" in data:
        return None
    if max(len(line) for line in data.split(b"\n")) > max_line:
        return None
    return data


def build_corpus(out_dir, *, max_mb=600.0, heldout_permille=15, max_heldout_mb=8.0, min_bytes=128,
                 max_file_kb=512, max_line=1000, workers=16, roots=None):
    """Collect, filter, de-duplicate and split the sources; write out_dir/{train.bin, heldout.bin, corpus.json}.

    Deterministic given the files on disk: candidates are visited in the order of a hash of their key (prefix +
    relative path), which is also what decides the split (held-out when hash % 1000 < heldout_permille), and the
    first file of each content hash wins. max_mb caps the train bytes (files are read in hash order until the
    raw sizes reach 1.3x the cap, then cut at the cap after filtering), so a bigger disk does not mean a slower
    build. Returns the stats dict (also in corpus.json).
    """
    start = time.time()
    os.makedirs(out_dir, exist_ok=True)
    roots = roots or source_roots()
    root_dirs = {r for _, r in roots}
    candidates = []
    for prefix, root in roots:
        candidates += _walk_sources(prefix, root, root_dirs - {root}, min_bytes, max_file_kb * 1024)
    candidates.sort(key=lambda c: (sha1_int(c[0]), c[0]))
    listed = time.time() - start
    heldout_of = {c[0]: sha1_int("split:" + c[0]) % 1000 < heldout_permille for c in candidates}
    budget = {False: max_mb * 1e6 * 1.3, True: max_heldout_mb * 1e6 * 1.3}
    chosen, raw = [], {False: 0, True: 0}
    for key, path, size in candidates:
        split = heldout_of[key]
        if raw[split] < budget[split]:
            chosen.append((key, path))
            raw[split] += size
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        datas = list(pool.map(lambda kp: _read_source(kp[1], max_line), chosen))
    seen, parts, files = set(), {False: [], True: []}, {False: [], True: []}
    sizes = {False: 0, True: 0}
    caps = {False: max_mb * 1e6, True: max_heldout_mb * 1e6}
    rejected = duplicates = 0
    for (key, _), data in zip(chosen, datas):
        if data is None:
            rejected += 1
            continue
        digest = hashlib.sha1(data).digest()
        if digest in seen:
            duplicates += 1
            continue
        seen.add(digest)
        split = heldout_of[key]
        if sizes[split] + len(data) + 1 > caps[split]:
            continue
        files[split].append({"key": key, "offset": sizes[split] + 1, "length": len(data)})
        parts[split].append(bytes([EOS_BYTE]) + data)
        sizes[split] += len(data) + 1
    for split, name in ((False, "train.bin"), (True, "heldout.bin")):
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(b"".join(parts[split]))
    stats = {
        "roots": [{"prefix": p, "dir": r} for p, r in roots],
        "candidate_files": len(candidates), "read_files": len(chosen),
        "rejected_files": rejected, "duplicate_files": duplicates,
        "train_files": len(files[False]), "train_bytes": sizes[False],
        "heldout_files": len(files[True]), "heldout_bytes": sizes[True],
        "heldout_permille": heldout_permille, "max_mb": max_mb, "max_file_kb": max_file_kb, "max_line": max_line,
        "split": "held-out iff sha1('split:' + key) % 1000 < heldout_permille; key = 'stdlib/' or 'site/' + "
                 "path relative to its root",
        "seconds": round(time.time() - start, 1), "listing_seconds": round(listed, 1),
    }
    with open(os.path.join(out_dir, "corpus.json"), "w") as f:
        json.dump({"stats": stats, "heldout_files": files[True]}, f)
    return stats


def load_corpus(corpus_dir):
    """(train uint8 array, heldout uint8 array, corpus.json dict)."""
    train = np.fromfile(os.path.join(corpus_dir, "train.bin"), dtype=np.uint8)
    heldout = np.fromfile(os.path.join(corpus_dir, "heldout.bin"), dtype=np.uint8)
    with open(os.path.join(corpus_dir, "corpus.json")) as f:
        meta = json.load(f)
    return train, heldout, meta


def bytes_to_ids(x):
    """uint8 (torch) -> int64 token ids, EOS_BYTE -> EOS_TOKEN_ID."""
    ids = x.long()
    return torch.where(ids == EOS_BYTE, torch.full_like(ids, EOS_TOKEN_ID), ids)


def extract_prompts(heldout, files, count, *, seed, min_len=200, max_len=400, per_package=2):
    """`count` prompts from distinct held-out files, cut at line starts: whole lines, 200..400 bytes, ending with a
    newline, at least half of the non-blank lines not comments, no line over 120 bytes. For variety, no
    __init__.py (often near-identical boilerplate across packages) and at most `per_package` prompts per top-level
    package (the stdlib counts by module). Deterministic: files in the order of a seeded hash of their key, the
    first line drawn from a generator seeded by (seed, key)."""
    order = sorted(files, key=lambda f: sha1_int(f"prompt{seed}:" + f["key"]))
    out, taken = [], {}
    for f in order:
        if len(out) == count:
            break
        package = f["key"].split("/")[1].removesuffix(".py")
        if (f["length"] < 2 * max_len or f["key"].endswith("__init__.py")
                or taken.get(package, 0) >= per_package):
            continue
        text = bytes(heldout[f["offset"]:f["offset"] + f["length"]]).decode("utf-8")
        lines = text.split("\n")[:-1]
        rng = np.random.default_rng(sha1_int(f"{seed}:" + f["key"]) % 2**63)
        want = int(rng.integers(min_len, max_len + 1))
        for _ in range(8):  # a few tries per file
            first = int(rng.integers(0, max(1, len(lines) - 5)))
            chunk, size = [], 0
            for line in lines[first:]:
                if size + len(line.encode()) + 1 > max_len:
                    break
                chunk.append(line)
                size += len(line.encode()) + 1
                if size >= want:
                    break
            body = [ln for ln in chunk if ln.strip()]
            code = [ln for ln in body if not ln.lstrip().startswith("#")]
            if (min_len <= size <= max_len and len(code) * 2 >= len(body) and
                    all(len(ln.encode()) <= 120 for ln in chunk) and chunk[0].strip()):
                out.append({"text": "\n".join(chunk) + "\n", "file": f["key"], "line": first + 1})
                taken[package] = taken.get(package, 0) + 1
                break
    return out


# ---------------------------------------------------------------------------------------------------------------
# models (the math and parameter names of transformers' Qwen3 and dflash.model, nothing else)
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class TargetShape:
    num_layers: int = 8
    hidden_size: int = 384
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096

    def hf_config(self):
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": None, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": self.num_layers, "tie_word_embeddings": False,
            "initializer_range": 0.02, "use_cache": True, "bos_token_id": None, "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": None, "dtype": "bfloat16",
        }


@dataclass
class DrafterShape:
    num_layers: int = 2
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    block_size: int = 16
    target_layer_ids: list = field(default_factory=lambda: [1, 4, 7])

    def hf_config(self, target: TargetShape, extra=None):
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": self.block_size,
            "dflash_config": {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": list(self.target_layer_ids),
                              **(extra or {})},
            "num_target_layers": target.num_layers, "vocab_size": target.vocab_size,
            "hidden_size": target.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0,
            "max_position_embeddings": target.max_position_embeddings, "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": target.rope_theta, "rope_scaling": None, "tie_word_embeddings": False,
            "initializer_range": 0.02, "use_cache": True, "dtype": "bfloat16",
        }


class RMSNorm(nn.Module):
    """transformers' Qwen3RMSNorm: normalize in fp32, cast back, then scale."""

    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(positions, head_dim, theta, dtype):
    """(cos, sin) [..., head_dim] for integer positions, as Qwen3RotaryEmbedding (default rope) computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [b, heads, t, d]; cos/sin [t, d] or [b, t, d]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _repeat_kv(x, groups):
    """[b, kv, t, d] -> [b, kv * groups, t, d], head h reading kv head h // groups (repeat_interleave's order;
    expand + reshape instead, which never waits for the device: repeat_interleave with an int can)."""
    if groups == 1:
        return x
    b, kv, t, d = x.shape
    return x[:, :, None].expand(b, kv, groups, t, d).reshape(b, kv * groups, t, d)


def _sdpa_has_gqa():
    try:
        F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4),
                                       enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


_SDPA_GQA = _sdpa_has_gqa()  # torch >= 2.5: grouped K/V read in place (no copies) where no mask is given


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, eps):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def project(self, x, proj, norm, heads, rope):
        b, t, _ = x.shape
        y = proj(x).view(b, t, heads, self.head_dim)
        if norm is not None:
            y = norm(y)
        y = y.transpose(1, 2)
        return apply_rope(y, *rope) if rope is not None else y

    def attend(self, q, k, v, mask=None, causal=False):
        groups = self.heads // self.kv_heads
        # Under autocast v is bf16 (a matmul output) while q/k are fp32 (RMSNorm's fp32 weight promotes them):
        # attend in v's dtype, which is what autocast would pick, and a no-op in fp32.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if mask is None and groups > 1 and _SDPA_GQA and not torch.is_grad_enabled():  # (training: as it was)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.head_dim ** -0.5,
                                                 enable_gqa=True)
        else:
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                 scale=self.head_dim ** -0.5)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def attend_one(self, q, k, v, bias):
        """One query row per sequence against a static cache: q [b, heads, 1, d]; k, v [b, kv_heads, S, d] (all S
        slots); bias [b, S] fp32, 0 where a slot is visible and -inf where not. Static shapes (CUDA-graph safe),
        the grouped K/V read in place; scores and softmax in fp32, the products in the cache's dtype."""
        b, heads, _, d = q.shape
        g = heads // self.kv_heads
        qg = q.to(k.dtype).reshape(b, self.kv_heads, g, d)
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * (self.head_dim ** -0.5) + bias[:, None, None, :]
        out = torch.matmul(scores.softmax(-1).to(v.dtype), v)                     # [b, kv, g, d]
        return self.o_proj(out.reshape(b, 1, heads * d))


class MLP(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, intermediate, eps):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def finish(self, x, attn):
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Static per-layer K/V [b, kv_heads, capacity, head_dim] (batched greedy rollouts, cached verification)."""

    def __init__(self, shape: TargetShape, batch, capacity, device, dtype, _kv=None):
        if _kv is not None:
            self.k, self.v = _kv
            return
        self.k = [torch.zeros(batch, shape.num_kv_heads, capacity, shape.head_dim, device=device, dtype=dtype)
                  for _ in range(shape.num_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]

    def view(self, rows=slice(None), slots=slice(None)):
        """A cache over a part of this one's storage (rows of the batch, the first slots): writes go through."""
        return KVCache(None, 0, 0, None, None, _kv=([k[rows, :, slots] for k in self.k],
                                                    [v[rows, :, slots] for v in self.v]))


class TargetModel(nn.Module):
    """Qwen3ForCausalLM (untied, full attention, default RoPE); state_dict() names are the HF checkpoint's."""

    def __init__(self, shape: TargetShape):
        super().__init__()
        self.shape = shape
        s = shape
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.model.layers = nn.ModuleList(Layer(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
                                                s.intermediate_size, s.rms_norm_eps) for _ in range(s.num_layers))
        self.model.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)

    def init_weights(self, generator):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
                continue
            scale = std / math.sqrt(2 * self.shape.num_layers) if name.endswith(("o_proj.weight",
                                                                                 "down_proj.weight")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=generator) * scale)

    def forward(self, ids, *, capture=(), cache=None, start=0, logits=True, fp32_logits=False):
        """ids [b, t] at positions start..start+t-1. Without a cache start must be 0 (causal over ids).
        Returns (logits [b, t, V] or final normed hidden, features [b, t, len(capture)*H] or None); features are
        HF's hidden_states[id + 1] for id in capture (the last layer's is the final NORMED state, as transformers
        ties hidden_states[-1] to last_hidden_state). fp32_logits: lm_head in fp32 even under autocast (greedy
        labels should not hinge on bf16 rounding of the logits)."""
        s = self.shape
        b, t = ids.shape
        x = self.model.embed_tokens(ids)
        positions = torch.arange(start, start + t, device=ids.device)
        rope = rope_tables(positions, s.head_dim, s.rope_theta, x.dtype)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.project(h, a.q_proj, a.q_norm, a.heads, rope)
            k = a.project(h, a.k_proj, a.k_norm, a.kv_heads, rope)
            v = a.project(h, a.v_proj, None, a.kv_heads, None)
            if cache is None:
                assert start == 0
                out = a.attend(q, k, v, causal=True)
            else:
                cache.k[i][:, :, start:start + t] = k
                cache.v[i][:, :, start:start + t] = v
                k, v = cache.k[i][:, :, :start + t], cache.v[i][:, :, :start + t]
                if t == 1:
                    out = a.attend(q, k, v)
                elif start == 0:
                    out = a.attend(q, k, v, causal=True)
                else:
                    mask = torch.ones(t, start + t, dtype=torch.bool, device=ids.device).tril(start)
                    out = a.attend(q, k, v, mask=mask)
            x = layer.finish(x, out)
            if i in capture and i != s.num_layers - 1:
                captured[i] = x
        x = self.model.norm(x)
        if s.num_layers - 1 in capture:
            captured[s.num_layers - 1] = x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        if not logits:
            return x, features
        if fp32_logits:
            with torch.autocast(x.device.type, enabled=False):
                return F.linear(x.float(), self.lm_head.weight.float()), features
        return self.lm_head(x), features

    def decode_one(self, tok, pos, cache, bias):
        """One greedy-decoding step of a batch, each sequence at its own position: tok [b] are the tokens at
        positions pos [b] (long, on the device, so that a CUDA graph can replay the step); their K/V go into the
        cache at slot pos (scatter_, no host sync); the slots whose bias [b, S] is 0 are attended (0 for slots <=
        pos, -inf after). Returns fp32 logits [b, V] of the next tokens. Same math as forward() with a cache (the
        attention in attend_one's order), static shapes throughout."""
        s = self.shape
        b = tok.shape[0]
        x = self.model.embed_tokens(tok)[:, None]
        rope = rope_tables(pos[:, None], s.head_dim, s.rope_theta, x.dtype)                  # [b, 1, d]
        index = pos.view(b, 1, 1, 1).expand(b, s.num_kv_heads, 1, s.head_dim)
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.project(h, a.q_proj, a.q_norm, a.heads, rope)
            k = a.project(h, a.k_proj, a.k_norm, a.kv_heads, rope)
            v = a.project(h, a.v_proj, None, a.kv_heads, None)
            cache.k[i].scatter_(2, index, k.to(cache.k[i].dtype))
            cache.v[i].scatter_(2, index, v.to(cache.v[i].dtype))
            x = layer.finish(x, a.attend_one(q, cache.k[i], cache.v[i], bias))
        x = self.model.norm(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x[:, 0].float(), self.lm_head.weight.float())


class DrafterModel(nn.Module):
    """dflash.model.DFlashDraftModel (full-attention, non-causal layers); state_dict() names are the checkpoint's.

    forward() runs many blocks of one sequence at once. For a block anchored at position a (block rows at
    positions a..a+B-1: the anchor token then B-1 masks), dflash_generate shows the drafter the context rows of
    every committed position BEFORE a (the anchor's own hidden state does not exist yet: it is computed by the
    verify of this very block) plus the block's own B rows, all without a causal mask. The training mask gives
    each block exactly that: context rows p < a and the rows of the same block, nothing else.
    """

    def __init__(self, shape: DrafterShape, target: TargetShape):
        super().__init__()
        self.shape, self.target_shape = shape, target
        H = target.hidden_size
        self.layers = nn.ModuleList(Layer(H, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                          shape.intermediate_size, target.rms_norm_eps)
                                    for _ in range(shape.num_layers))
        self.norm = RMSNorm(H, target.rms_norm_eps)
        self.fc = nn.Linear(len(shape.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, target.rms_norm_eps)

    def init_weights(self, generator):
        for name, p in self.named_parameters():
            with torch.no_grad():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    scale = 0.02 / math.sqrt(2 * self.shape.num_layers) if name.endswith(
                        ("o_proj.weight", "down_proj.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=generator) * scale)

    def forward(self, features, noise, noise_positions, mask=None):
        """features [b, C, n_ids*H]: context rows at positions 0..C-1; noise [b, M, H]: block rows' input
        embeddings at noise_positions [b, M]; mask [b, 1, M, C+M] bool (True = visible) or None (all visible,
        i.e. one block over all of its context). Returns the final normed hidden states [b, M, H]."""
        t = self.target_shape
        ctx = self.hidden_norm(self.fc(features))
        b, C, _ = ctx.shape
        ctx_rope = rope_tables(torch.arange(C, device=ctx.device), self.shape.head_dim, t.rope_theta, noise.dtype)
        noise_rope = rope_tables(noise_positions, self.shape.head_dim, t.rope_theta, noise.dtype)
        x = noise
        for layer in self.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.project(h, a.q_proj, a.q_norm, a.heads, noise_rope)
            k = torch.cat([a.project(ctx, a.k_proj, a.k_norm, a.kv_heads, ctx_rope),
                           a.project(h, a.k_proj, a.k_norm, a.kv_heads, noise_rope)], dim=2)
            v = torch.cat([a.project(ctx, a.v_proj, None, a.kv_heads, None),
                           a.project(h, a.v_proj, None, a.kv_heads, None)], dim=2)
            x = layer.finish(x, a.attend(q, k, v, mask=mask))
        return self.norm(x)


def block_mask(anchors, context_len, block_size):
    """[b, 1, N*B, C+N*B] bool for anchors [b, N]: block j sees context rows p < anchors[:, j] and its own rows."""
    b, n = anchors.shape
    device = anchors.device
    ctx = torch.arange(context_len, device=device)[None, None, :] < anchors[:, :, None]        # [b, N, C]
    ctx = ctx[:, :, None, :].expand(b, n, block_size, context_len).reshape(b, n * block_size, context_len)
    blk = torch.arange(n * block_size, device=device) // block_size
    own = (blk[:, None] == blk[None, :])[None].expand(b, -1, -1)                                  # [b, M, M]
    return torch.cat([ctx, own], dim=-1)[:, None]


# ---------------------------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------------------------

def save_checkpoint(module, config, out_dir):
    """config.json + model.safetensors (bf16), the HF layout."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: p.detach().to("cpu", torch.bfloat16).contiguous() for name, p in module.state_dict().items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return out_dir


def _load_state(module, directory):
    from safetensors.torch import load_file

    state = load_file(os.path.join(directory, "model.safetensors"))
    module.load_state_dict({k: v.float() for k, v in state.items()})
    return module


def target_shape_from_config(cfg):
    return TargetShape(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                       num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
                       head_dim=cfg["head_dim"], intermediate_size=cfg["intermediate_size"],
                       vocab_size=cfg["vocab_size"], rope_theta=cfg["rope_theta"], rms_norm_eps=cfg["rms_norm_eps"],
                       max_position_embeddings=cfg["max_position_embeddings"])


def load_target(directory):
    with open(os.path.join(directory, "config.json")) as f:
        shape = target_shape_from_config(json.load(f))
    return _load_state(TargetModel(shape), directory)


def load_drafter(directory, target_shape):
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    shape = DrafterShape(num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                         num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                         intermediate_size=cfg["intermediate_size"], block_size=cfg["block_size"],
                         target_layer_ids=list(cfg["dflash_config"]["target_layer_ids"]))
    return _load_state(DrafterModel(shape, target_shape), directory)


def bf16_rounded(module):
    """The module with every parameter rounded to bf16 (kept in fp32): what the shipped checkpoint holds."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return module


# ---------------------------------------------------------------------------------------------------------------
# greedy decoding (torch, batch 1, KV-cached like dflash_generate: for measuring acceptance)
# ---------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def greedy_generate(target, prompt_ids, max_new_tokens, stop_ids=(EOS_TOKEN_ID,)):
    device = target.lm_head.weight.device
    cache = KVCache(target.shape, 1, len(prompt_ids) + max_new_tokens, device, target.lm_head.weight.dtype)
    logits, _ = target(torch.tensor([list(prompt_ids)], device=device), cache=cache)
    out = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in stop_ids or len(out) == max_new_tokens:
            break
        logits, _ = target(torch.tensor([[token]], device=device), cache=cache,
                           start=len(prompt_ids) + len(out) - 1)
    return out


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids, max_new_tokens, stop_ids=(EOS_TOKEN_ID,), block_size=None):
    """Greedy speculative decoding step for step as dflash.model.dflash_generate (block widths near the end,
    produced = min(accepted + 1, room), stop-token truncation). Returns (new_ids, acceptance_lengths).

    The target keeps a KV cache (each verify writes its block at positions start.., the next one overwrites what
    was rejected); the drafter's context is the captured features of the committed positions, [1, start, F]
    when it drafts from the anchor at `start` (the prefill's rows, then each verify's first `produced` rows)."""
    device = target.lm_head.weight.device
    ids_of = lambda seq: torch.tensor([seq], device=device)  # noqa: E731
    capture = tuple(drafter.shape.target_layer_ids)
    block_size = block_size or drafter.shape.block_size
    n_in = len(prompt_ids)
    max_length = n_in + max_new_tokens
    cache = KVCache(target.shape, 1, max_length + 1, device, target.lm_head.weight.dtype)
    logits, context = target(ids_of(list(prompt_ids)), capture=capture, cache=cache)
    output = list(prompt_ids) + [int(logits[0, -1].argmax())]
    lengths = []
    start = n_in
    stop = set(stop_ids or ())
    stopped = output[start] in stop
    while start + 1 < max_length and not stopped:
        verify_size = min(block_size, max_length - start)
        block = [output[start]]
        if verify_size > 1:
            noise_ids = ids_of([output[start]] + [MASK_TOKEN_ID] * (verify_size - 1))
            noise = target.model.embed_tokens(noise_ids)
            positions = torch.arange(start, start + verify_size, device=device)[None]
            hidden = drafter(context, noise, positions)
            block += target.lm_head(hidden[0, 1:]).argmax(-1).tolist()
        logits, features = target(ids_of(block), capture=capture, cache=cache, start=start)
        posterior = logits[0].argmax(-1).tolist()
        accepted = 0
        while accepted < verify_size - 1 and block[accepted + 1] == posterior[accepted]:
            accepted += 1
        output = output[:start] + block[:accepted + 1] + [posterior[accepted]]
        produced = min(accepted + 1, max_length - start - 1)
        for i, token in enumerate(output[start + 1:start + produced + 1]):
            if token in stop:
                produced, stopped = i + 1, True
                break
        context = torch.cat([context, features[:, :produced]], dim=1)
        start += produced
        output = output[:start + 1]
        lengths.append(produced)
    return output[n_in:min(start + 1, max_length)], lengths


def to_jsonable(x):
    if isinstance(x, dict):
        return {k: to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if hasattr(x, "__dataclass_fields__"):
        return to_jsonable(asdict(x))
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    return x


def environment():
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu_count": os.cpu_count()}
