"""Drafter and target configs, read from config.json exactly as dflash.model + transformers' Qwen3Config /
LlamaConfig do.

The oracle is `dflash.model` (PyPI dflash 0.1.0) on transformers 5.15: DFlash fields go through
`_draft_value(config, name, default)` (the `dflash_config` dict first, then the root), everything else through
Qwen3Config's (or LlamaConfig's) defaults and __post_init__, and RoPE through transformers'
`convert_rope_params_to_dict` / `standardize_rope_params`. What the engine cannot run is refused here with a
ValueError naming the field.
"""

import json
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

# Qwen3Config's defaults (transformers 5.15). A field absent from config.json gets these, not values derived
# from other fields: e.g. num_key_value_heads is 32 and head_dim is 128 whatever hidden_size and heads are.
_QWEN3_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
# LlamaConfig's defaults (transformers 5.15); head_dim and num_key_value_heads are derived when absent or null.
_LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Target architectures the engine runs: (model_type, HF class) -> the name used in TargetConfig.arch, whose
# order is enum dflash_arch.
_ARCHS = {"qwen3": ("qwen3", "Qwen3ForCausalLM"), "llama": ("llama", "LlamaForCausalLM")}
_ARCH_ORDER = ("qwen3", "llama")
_DEFAULT_ROPE_THETA = 10000.0  # RotaryEmbeddingConfigMixin.default_theta
_LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_TYPES = ("default", "yarn", "llama3")  # the order of enum dflash_rope_type


def build_target_layer_ids(num_target_layers, num_draft_layers):
    """dflash.model.build_target_layer_ids (Python's round(), i.e. banker's rounding, as the reference)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _read_json(source):
    """A dict is used as is; a directory means its config.json; anything else is a JSON file path."""
    if isinstance(source, dict):
        return source
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _fill_model_params(p, config):
    """The fields dflash_drafter_params and dflash_target_params share, from a DrafterConfig or TargetConfig
    (which declare them alike: num_layers through rope)."""
    p.num_layers, p.hidden_size, p.intermediate_size = config.num_layers, config.hidden_size, config.intermediate_size
    p.num_heads, p.num_kv_heads, p.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    p.vocab_size, p.rms_norm_eps = config.vocab_size, config.rms_norm_eps
    p.max_position_embeddings = config.max_position_embeddings
    config.rope.fill(p.rope)


@dataclass(frozen=True)
class RopeConfig:
    """dflash_rope_params. 0 in factor/original_max_position/attention_factor means "computed as transformers
    does" in the library (factor = max_position / original, attention factor from factor and mscales)."""

    type: str = "default"
    theta: float = _DEFAULT_ROPE_THETA
    factor: float = 0.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def fill(self, c_rope):
        """Write these values into a cffi `dflash_rope_params` (a field of the drafter or target params)."""
        c_rope.type = _ROPE_TYPES.index(self.type)
        c_rope.theta, c_rope.factor, c_rope.original_max_position = self.theta, self.factor, self.original_max_position
        c_rope.beta_fast, c_rope.beta_slow, c_rope.attention_factor = self.beta_fast, self.beta_slow, \
            self.attention_factor
        c_rope.mscale, c_rope.mscale_all_dim, c_rope.truncate = self.mscale, self.mscale_all_dim, int(self.truncate)
        c_rope.low_freq_factor, c_rope.high_freq_factor = self.low_freq_factor, self.high_freq_factor

    @classmethod
    def from_config(cls, cfg, layer_types, max_position_embeddings):
        """Both spellings: transformers 5's `rope_parameters` dict, or legacy root `rope_theta` + `rope_scaling`.

        Mirrors convert_rope_params_to_dict: a truthy rope_scaling replaces rope_parameters; root rope_theta only
        fills a theta the dict lacks; `rope_type` wins over the older `type`.
        """
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"rope_parameters/rope_scaling must be an object, got {rope!r}")
        if rope and set(rope) <= set(layer_types):
            raise ValueError(f"per-layer-type rope_parameters ({sorted(rope)}) are not supported")
        rope = dict(rope)
        rope.setdefault("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA))
        partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
        if partial is not None and float(partial) != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
        if rope["rope_theta"] is None or not float(rope["rope_theta"]) > 0:
            raise ValueError(f"rope_theta must be > 0, got {rope['rope_theta']!r}")
        required = {"default": (), "yarn": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
        missing = [k for k in required[rope_type] if k not in rope]
        if missing:  # transformers raises KeyError("Missing required keys in `rope_parameters` ...") here
            raise ValueError(f"rope_parameters of rope_type {rope_type!r} lacks {', '.join(missing)}")

        def number(key, default=0.0):
            value = rope.get(key)
            return default if value is None else float(value)

        out = cls(type=rope_type, theta=float(rope["rope_theta"]))
        if rope_type == "default":
            return out
        original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
        if rope_type == "yarn":
            attention_factor = rope.get("attention_factor")
            if attention_factor is not None and not float(attention_factor) > 0:
                raise ValueError(f"rope attention_factor must be > 0 when given, got {attention_factor!r}")
            return cls(type="yarn", theta=out.theta, factor=number("factor"), original_max_position=original,
                       # transformers: `rope_parameters.get("beta_fast") or 32`, so 0 and null mean the default
                       beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                       attention_factor=number("attention_factor"), mscale=number("mscale"),
                       mscale_all_dim=number("mscale_all_dim"), truncate=bool(rope.get("truncate", True)))
        return cls(type="llama3", theta=out.theta, factor=number("factor"), original_max_position=original,
                   low_freq_factor=number("low_freq_factor"), high_freq_factor=number("high_freq_factor"))


@dataclass(frozen=True)
class DrafterConfig:
    """The model part of dflash_drafter_params, from a DFlash drafter's config.json."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    sliding_window: int | None  # None: no window (Qwen3Config drops it unless use_sliding_window)
    is_causal: bool | None  # None: sliding layers causal, full layers not (dflash.model)
    layer_types: tuple[str, ...]
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None  # as the drafter's config states it; the target's config is authoritative
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0  # 0: none
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, source: dict | str | PathLike) -> "DrafterConfig":
        """source: a parsed config dict, a config.json path, or a checkpoint directory."""
        cfg = _read_json(source)
        dflash = cfg.get("dflash_config") or {}

        def value(name):  # Qwen3Config attribute: the JSON value, else the class default
            return cfg.get(name, _QWEN3_DEFAULTS.get(name))

        def draft_value(name, default=None):  # dflash.model._draft_value
            return dflash.get(name, cfg.get(name, default))

        if any(k in dflash or k in cfg for k in ("conv_kernel_size", "selector_rank")):
            raise ValueError("DFlash2 drafters (conv_kernel_size / selector_rank) are not supported yet")
        if value("attention_bias"):
            raise ValueError("attention_bias is not supported")
        if value("hidden_act") != "silu":
            raise ValueError(f"hidden_act {value('hidden_act')!r} is not supported (only 'silu')")

        num_layers = int(value("num_hidden_layers"))
        num_heads = int(value("num_attention_heads"))
        # Qwen3Config: an explicit null means "as many as query heads"; absent means the class default (32).
        num_kv_heads = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else value("num_key_value_heads")
        num_kv_heads = num_heads if num_kv_heads is None else int(num_kv_heads)
        hidden = int(value("hidden_size"))
        # dflash.model: getattr(config, "head_dim", hidden // heads); Qwen3Config always has one (default 128).
        head_dim = value("head_dim")
        head_dim = hidden // num_heads if head_dim is None else int(head_dim)

        sliding_window = value("sliding_window") if value("use_sliding_window") else None
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            max_window_layers = value("max_window_layers")
            layer_types = ["sliding_attention" if sliding_window is not None and i >= max_window_layers
                           else "full_attention" for i in range(num_layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != num_layers or not set(layer_types) <= set(_LAYER_TYPES):
            raise ValueError(f"layer_types must be {num_layers} entries of {_LAYER_TYPES}, got {list(layer_types)}")
        is_causal = cfg.get("is_causal")

        max_position = int(value("max_position_embeddings"))
        rope = RopeConfig.from_config(cfg, layer_types, max_position)

        num_target_layers = cfg.get("num_target_layers")
        target_layer_ids = draft_value("target_layer_ids")
        if target_layer_ids is None:
            if num_target_layers is None:
                raise ValueError("config has neither target_layer_ids (dflash_config or root) nor num_target_layers")
            target_layer_ids = build_target_layer_ids(int(num_target_layers), num_layers)
        mask_token_id = draft_value("mask_token_id")
        if mask_token_id is None:
            raise ValueError("mask_token_id is missing (dflash_config.mask_token_id or root)")
        softcap = draft_value("final_logit_softcapping")
        # dflash.model applies the softcap only when `softcap is not None and float(softcap) > 0`.
        softcap = float(softcap) if softcap is not None and float(softcap) > 0 else 0.0

        return cls(
            num_layers=num_layers, hidden_size=hidden, intermediate_size=int(value("intermediate_size")),
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            vocab_size=int(value("vocab_size")), rms_norm_eps=float(value("rms_norm_eps")),
            max_position_embeddings=max_position, rope=rope,
            sliding_window=None if sliding_window is None else int(sliding_window),
            is_causal=None if is_causal is None else bool(is_causal), layer_types=layer_types,
            block_size=int(draft_value("block_size", 16)), mask_token_id=int(mask_token_id),
            target_layer_ids=tuple(int(i) for i in target_layer_ids),
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
            output_multiplier=float(draft_value("output_multiplier", 1.0)),
            final_logit_softcapping=softcap, raw=cfg)

    def tensor_shapes(self, target: "TargetInfo") -> dict:
        """{name: shape} of every tensor the library expects, the target's embed_tokens / lm_head included."""
        H, I, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        shapes = {"fc.weight": (H, len(self.target_layer_ids) * target.hidden_size),
                  "hidden_norm.weight": (H,), "norm.weight": (H,),
                  "embed_tokens.weight": (target.vocab_size, H)}
        if not target.tie_word_embeddings:
            shapes["lm_head.weight"] = (target.vocab_size, H)
        for i in range(self.num_layers):
            p = f"layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I)})
        return shapes

    def check_target(self, target: "TargetInfo"):
        """The drafter shares the target's embeddings and reads its layers: sizes must agree."""
        problems = []
        if target.hidden_size != self.hidden_size:
            problems.append(f"target hidden_size {target.hidden_size} != drafter hidden_size {self.hidden_size}")
        if target.vocab_size != self.vocab_size:
            problems.append(f"target vocab_size {target.vocab_size} != drafter vocab_size {self.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's {target.num_hidden_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} >= vocab {target.vocab_size}")
        if problems:
            raise ValueError("drafter does not fit the target: " + "; ".join(problems))

    def to_params(self, ffi, lib, *, target: "TargetInfo | None" = None, max_batch=1, max_seq_len=4096,
                  ctx_window=0, ctx_chunk_rows=0):
        """A filled `dflash_drafter_params *` (cffi-owned). Target fields come from `target` when given."""
        if len(self.layer_types) > lib.DFLASH_MAX_LAYERS:
            raise ValueError(f"num_hidden_layers {self.num_layers} > DFLASH_MAX_LAYERS {lib.DFLASH_MAX_LAYERS}")
        if len(self.target_layer_ids) > lib.DFLASH_MAX_TARGET_LAYER_IDS:
            raise ValueError(f"{len(self.target_layer_ids)} target_layer_ids > DFLASH_MAX_TARGET_LAYER_IDS "
                             f"{lib.DFLASH_MAX_TARGET_LAYER_IDS}")
        p = ffi.new("dflash_drafter_params *", lib.dflash_drafter_default_params())
        _fill_model_params(p, self)
        p.sliding_window = self.sliding_window or 0
        p.is_causal = -1 if self.is_causal is None else int(self.is_causal)
        for i, kind in enumerate(self.layer_types):
            p.layer_types[i] = _LAYER_TYPES.index(kind)
        p.block_size, p.mask_token_id = self.block_size, self.mask_token_id
        p.num_target_layer_ids = len(self.target_layer_ids)
        for i, layer in enumerate(self.target_layer_ids):
            p.target_layer_ids[i] = layer
        p.num_target_layers = target.num_hidden_layers if target else (self.num_target_layers or 0)
        p.target_hidden_size = target.hidden_size if target else 0
        p.tie_word_embeddings = int(target.tie_word_embeddings) if target else 0
        p.input_embedding_scale = self.input_embedding_scale
        p.output_multiplier = self.output_multiplier
        p.final_logit_softcapping = self.final_logit_softcapping
        p.max_batch, p.max_seq_len, p.ctx_window, p.ctx_chunk_rows = max_batch, max_seq_len, ctx_window, ctx_chunk_rows
        return p


@dataclass(frozen=True)
class TargetInfo:
    """What the drafter needs from its target's config.json."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    tie_word_embeddings: bool

    @classmethod
    def from_json(cls, source: dict | str | PathLike) -> "TargetInfo":
        cfg = _read_json(source)
        text = cfg.get("text_config") or {}  # multimodal wrappers keep the language model's sizes there
        missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if k not in cfg and k not in text]
        if missing:
            raise ValueError(f"target config lacks {', '.join(missing)}")

        def value(name, default=None):
            return cfg[name] if name in cfg else text.get(name, default)

        # Qwen3Config (and most decoder configs in transformers 5) default to untied embeddings.
        return cls(hidden_size=int(value("hidden_size")), vocab_size=int(value("vocab_size")),
                   num_hidden_layers=int(value("num_hidden_layers")),
                   tie_word_embeddings=bool(value("tie_word_embeddings", False)))



def _token_ids(value, name):
    """A config's int / list of ints / null token-id field as a list."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{name} must be a non-negative int or a list of them, got {value!r}")
    return list(values)


@dataclass(frozen=True)
class TargetConfig:
    """The model part of dflash_target_params, from a Qwen3ForCausalLM or LlamaForCausalLM config.json, with the
    defaults and derivations of transformers' Qwen3Config / LlamaConfig."""

    arch: str  # "qwen3" | "llama"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    eos_token_ids: list  # stop tokens a caller may use; generation_config.json's when the directory has one
    bos_token_id: int | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, source: dict | str | PathLike) -> "TargetConfig":
        """source: a parsed config dict, a config.json path, or a checkpoint directory (whose
        generation_config.json, if any, supplies eos_token_id as transformers' generate() would take it)."""
        cfg = _read_json(source)
        model_type, architectures = cfg.get("model_type"), cfg.get("architectures") or []
        arch = next((name for name, (mtype, hf_class) in _ARCHS.items()
                     if model_type == mtype or hf_class in architectures), None)
        if arch is None:
            supported = ", ".join(f"{m} ({c})" for m, c in _ARCHS.values())
            raise ValueError(f"target model_type {model_type!r} / architectures {architectures} is not supported "
                             f"(supported: {supported})")
        defaults = _QWEN3_DEFAULTS if arch == "qwen3" else _LLAMA_DEFAULTS

        def value(name):
            return cfg.get(name, defaults.get(name))

        if value("hidden_act") != "silu":
            raise ValueError(f"hidden_act {value('hidden_act')!r} is not supported (only 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if value(flag):
                raise ValueError(f"{flag} is not supported")
        num_layers, num_heads = int(value("num_hidden_layers")), int(value("num_attention_heads"))
        hidden = int(value("hidden_size"))
        if arch == "qwen3":
            # Qwen3Config: an explicit null means "as many as query heads"; absent means the class default (32).
            num_kv_heads = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else value("num_key_value_heads")
            head_dim = value("head_dim")
            layer_types = cfg.get("layer_types")
            if layer_types is None:
                window = value("sliding_window") if value("use_sliding_window") else None
                layer_types = ["sliding_attention" if window is not None and i >= value("max_window_layers")
                               else "full_attention" for i in range(num_layers)]
            if "sliding_attention" in layer_types:
                raise ValueError("sliding-window attention layers (use_sliding_window / layer_types) are not "
                                 "supported in a target")
        else:
            num_kv_heads, head_dim = value("num_key_value_heads"), value("head_dim")
            if hidden % num_heads:  # LlamaConfig.validate_architecture
                raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {num_heads}")
            layer_types = ["full_attention"] * num_layers
        num_kv_heads = num_heads if num_kv_heads is None else int(num_kv_heads)
        head_dim = hidden // num_heads if head_dim is None else int(head_dim)
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
                             f"{num_kv_heads}")
        max_position = int(value("max_position_embeddings"))
        rope = RopeConfig.from_config(cfg, tuple(layer_types), max_position)

        eos = value("eos_token_id")
        if not isinstance(source, dict) and Path(source).is_dir():
            generation = Path(source) / "generation_config.json"
            if generation.is_file():
                gen = _read_json(generation)
                if gen.get("eos_token_id") is not None:
                    eos = gen["eos_token_id"]
        bos = value("bos_token_id")
        return cls(arch=arch, num_layers=num_layers, hidden_size=hidden,
                   intermediate_size=int(value("intermediate_size")), num_heads=num_heads,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=int(value("vocab_size")),
                   rms_norm_eps=float(value("rms_norm_eps")), max_position_embeddings=max_position, rope=rope,
                   tie_word_embeddings=bool(value("tie_word_embeddings")),
                   eos_token_ids=_token_ids(eos, "eos_token_id"), bos_token_id=None if bos is None else int(bos),
                   raw=cfg)

    @property
    def info(self) -> TargetInfo:
        """What a drafter needs to know about this target."""
        return TargetInfo(self.hidden_size, self.vocab_size, self.num_layers, self.tie_word_embeddings)

    def tensor_shapes(self) -> dict:
        """{name: shape} of every tensor the library expects, without the checkpoint's "model." prefix."""
        H, I, hd, V = self.hidden_size, self.intermediate_size, self.head_dim, self.vocab_size
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        shapes = {"embed_tokens.weight": (V, H), "norm.weight": (H,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, H)
        for i in range(self.num_layers):
            p = f"layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I)})
            if self.arch == "qwen3":
                shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        return shapes

    def to_params(self, ffi, lib, *, max_batch=1, max_seq_len=4096, max_verify_rows=16, prefill_chunk=None):
        """A filled `dflash_target_params *` (cffi-owned); prefill_chunk None keeps the library's default."""
        p = ffi.new("dflash_target_params *", lib.dflash_target_default_params())
        p.arch = _ARCH_ORDER.index(self.arch)
        _fill_model_params(p, self)
        p.tie_word_embeddings = int(self.tie_word_embeddings)
        p.max_batch, p.max_seq_len = max_batch, max_seq_len
        p.max_verify_rows = max_verify_rows
        if prefill_chunk is not None:
            p.prefill_chunk = prefill_chunk
        return p
