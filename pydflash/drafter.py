"""Drafter and Sequence: Python handles over dflash_drafter / dflash_drafter_seq.

The library owns every weight and KV byte; these classes describe (config, tensors), orchestrate and check
arguments that C cannot check itself (a buffer's dtype, shape and layout: ffi.from_buffer sees only bytes).
A drafter and its sequences must be used by one thread at a time (the library's rule).
"""

import numpy as np

from . import _ffi
from ._handle import NativeModel, NativeSequence, backend_code, context_params, create_native, new_struct, \
    struct_dict
from .checkpoint import CheckpointError, as_tensor, check_tensors, load_tensors
from .config import DrafterConfig, TargetInfo
from .sampling import sampling_pointer

# Where a Hugging Face causal LM keeps the two tensors the drafter borrows, by the drafter's name for them.
_TARGET_TENSORS = {
    "embed_tokens.weight": ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
    "lm_head.weight": ("lm_head.weight",),
}
# Feature dtype spellings -> (dflash_dtype name, numpy dtype names the array may have).
_FEATURE_DTYPES = {
    "f32": ("DFLASH_DTYPE_F32", ("float32",)),
    "f16": ("DFLASH_DTYPE_F16", ("float16",)),
    "bf16": ("DFLASH_DTYPE_BF16", ("bfloat16", "uint16")),  # ml_dtypes.bfloat16, or its bits as uint16
}
_DTYPE_ALIASES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _feature_dtype(array, dtype):
    """The dflash_dtype name for a features array, or a TypeError saying what to pass instead."""
    name = array.dtype.name
    if dtype is None:
        if name == "uint16":
            raise TypeError("uint16 features are ambiguous; pass dtype='bf16' if they are bfloat16 bits")
        dtype = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(name)
        if dtype is None:
            raise TypeError(f"features must be float32, float16 or bfloat16, got {array.dtype}")
    key = _DTYPE_ALIASES.get(dtype, dtype)
    if key not in _FEATURE_DTYPES:
        raise ValueError(f"dtype must be one of f32, f16, bf16, got {dtype!r}")
    code, accepted = _FEATURE_DTYPES[key]
    if name not in accepted:
        raise TypeError(f"dtype={dtype!r} needs an array of {' or '.join(accepted)}, got {array.dtype}")
    if not array.dtype.isnative:
        raise TypeError(f"features must be in native byte order, got {array.dtype.str}")
    return code


class Sequence(NativeSequence):
    """One sequence's drafter state (its KV blocks live in the drafter's pool). Made by Drafter.new_sequence."""

    def __init__(self, drafter, handle):
        super().__init__(drafter, handle)
        self._drafter = drafter  # the owner by its own name (TargetSequence tells a drafter Sequence by it)
        ffi = drafter._lib.ffi
        self._max_drafts = max(drafter.block_size - 1, 1)
        self._tokens = ffi.new("int32_t[]", self._max_drafts)
        self._count = ffi.new("int32_t *")

    def append_context(self, features, first_pos=None, *, dtype=None):
        """Append context rows: the target's hidden states after target_layer_ids, [n_rows, feature_width],
        C-contiguous float32 / float16 / bfloat16 (ml_dtypes, or uint16 bits with dtype="bf16"). Rows get
        positions first_pos, first_pos+1, ... (None: one past the last row). The array may be reused on return.
        """
        handle = self._live()
        if not isinstance(features, np.ndarray):
            raise TypeError(f"features must be a numpy array, got {type(features).__name__}")
        width = self._drafter.feature_width
        if features.ndim != 2 or features.shape[1] != width:
            raise ValueError(f"features must have shape [n_rows, {width}] (n_ids * target hidden), "
                             f"got {list(features.shape)}")
        if not features.flags.c_contiguous:
            raise ValueError("features must be C-contiguous (np.ascontiguousarray)")
        code = _feature_dtype(features, dtype)
        lib = self._drafter._lib
        # A uint8 view exports a plain byte buffer whatever the dtype (ml_dtypes' bfloat16 has no buffer format).
        data = lib.ffi.from_buffer(features.view(np.uint8)) if features.size else lib.ffi.NULL
        lib.check(lib.lib.dflash_drafter_seq_append_context(
            handle, data, getattr(lib.lib, code), 0, features.shape[0], -1 if first_pos is None else first_pos))

    def append_context_device(self, data_ptr, n_rows, dtype, first_pos=None):
        """As append_context, from a device pointer on the context's device (cuda backend). The rows are read on
        the context's stream: order their producer before this call."""
        key = _DTYPE_ALIASES.get(dtype, dtype)
        if key not in _FEATURE_DTYPES:
            raise ValueError(f"dtype must be one of f32, f16, bf16, got {dtype!r}")
        lib = self._drafter._lib
        lib.check(lib.lib.dflash_drafter_seq_append_context(
            self._live(), lib.ffi.cast("const void *", int(data_ptr)), getattr(lib.lib, _FEATURE_DTYPES[key][0]),
            1, n_rows, -1 if first_pos is None else first_pos))

    def propose(self, last_token, position, num_drafts, sampling=None) -> list:
        """Draft tokens for the block anchored at last_token (the last committed token) at `position` (one past
        the last context row). Returns clamp(num_drafts + 1, 2, block_size) - 1 token ids; the block must fit
        the budget. after_verify must follow before the next propose or append_context.

        sampling (a SamplingParams): draft_mode "sample" draws each draft from the drafter's own distribution and
        keeps it as the proposal the target's verify rejection-samples against; "greedy" (or None, or
        temperature 0) proposes the argmax."""
        lib = self._drafter._lib
        if sampling is None:
            lib.check(lib.lib.dflash_drafter_seq_propose(self._live(), last_token, position, num_drafts,
                                                         self._tokens, self._max_drafts, self._count))
        else:
            lib.check(lib.lib.dflash_drafter_seq_propose_sampled(
                self._live(), last_token, position, num_drafts, sampling_pointer(lib, sampling), self._tokens,
                self._max_drafts, self._count))
        return lib.ffi.unpack(self._tokens, self._count[0])

    def read_hidden(self) -> np.ndarray:
        """float32 [num_drafts, hidden_size]: the final normed hidden states of the last propose's drafts.
        Readable until the next propose of any sequence of this drafter (they live in its scratch)."""
        lib = self._drafter._lib
        out = np.empty((self._max_drafts, self._drafter.hidden_size), dtype=np.float32)
        lib.check(lib.lib.dflash_drafter_seq_read_hidden(
            self._live(), lib.ffi.from_buffer("float[]", out, require_writable=True), out.size, self._count))
        return out[: self._count[0]]

    def after_verify(self, num_accepted):
        """The target accepted num_accepted drafts of the last propose. If a TargetSequence.verify staged this
        block's features here, the first num_accepted + 1 rows become context rows; otherwise append them."""
        lib = self._drafter._lib
        lib.check(lib.lib.dflash_drafter_seq_after_verify(self._live(), num_accepted))

    def info(self) -> dict:
        """dflash_seq_info as a dict: budget_tokens, next_position, context_rows, cached_rows, pending_rows,
        blocks_held, proposals, accepted_drafts, graph_replays (proposes whose block replayed a CUDA graph)."""
        lib = self._drafter._lib
        out = new_struct(lib.ffi, "dflash_seq_info")
        lib.check(lib.lib.dflash_drafter_seq_info(self._live(), out))
        return struct_dict(lib.ffi, out)

    def reset(self):
        """Return every KV block and restart at position 0, keeping the handle and budget."""
        lib = self._drafter._lib
        lib.check(lib.lib.dflash_drafter_seq_reset(self._live()))


class Drafter(NativeModel):
    """A DFlash drafter on one backend. Create with Drafter.from_pretrained; free with close() / `with`."""

    _kind, _sequence_class = "drafter", Sequence

    def __init__(self, lib, context, handle, config, target_info, backend, device, *, target=None,
                 max_seq_len=4096):
        super().__init__(lib, context, handle)  # context None: the target's is shared
        self.config, self.target_info, self.backend, self.device = config, target_info, backend, device
        self.target = target  # the Target whose weights and context this drafter shares; None when standalone
        self.max_seq_len = max_seq_len
        self.block_size = config.block_size
        self.hidden_size = config.hidden_size
        self.feature_width = len(config.target_layer_ids) * target_info.hidden_size

    @classmethod
    def from_pretrained(cls, draft_dir, target_dir=None, backend=None, device=None, *, target=None, max_batch=1,
                        max_seq_len=4096, ctx_window=0, ctx_chunk_rows=0, stream=None) -> "Drafter":
        """Load a DFlash drafter checkpoint (HF layout) for its target, given exactly one way:

        - target=Target: share that target's context, embed_tokens and lm_head in memory (nothing is copied; the
          backend, device and stream are the target's). Its sequences can then be fed by the target's prefill
          and verify (hidden-state capture), which pydflash.generate needs.
        - target_dir: a standalone drafter that copies embed_tokens / lm_head from the target checkpoint (only
          those two tensors are mapped) and gets context rows through Sequence.append_context.
          backend "host" (default) or "cuda"; `stream` a CUDA stream to enqueue on (int, torch/CuPy/cuda-python
          stream; None: the library makes one).
        """
        if (target_dir is None) == (target is None):
            raise ValueError("give exactly one of target_dir (a checkpoint directory) or target (a pydflash.Target)")
        backend, device, target_info = _placement(target, target_dir, backend, device, stream)
        config = DrafterConfig.from_json(draft_dir)
        config.check_target(target_info)
        expected = _expected_shapes(config, target_info, target)
        tensors = _gather_tensors(draft_dir, target_dir, expected)
        return cls._create(config, target_info, tensors, target, backend, device, stream, max_batch, max_seq_len,
                           ctx_window, ctx_chunk_rows)

    @classmethod
    def from_tensors(cls, config, tensors, *, target=None, target_config=None, backend=None, device=None,
                     max_batch=1, max_seq_len=4096, ctx_window=0, ctx_chunk_rows=0, stream=None) -> "Drafter":
        """A drafter from weights already in memory: `config` a DrafterConfig, a config.json dict or path;
        `tensors` {name: numpy array (float32 / float16 / ml_dtypes bfloat16) or pydflash.Tensor}. Exactly one of
        target (a pydflash.Target whose embed_tokens / lm_head / context are shared, as from_pretrained) or
        target_config (the target's config: a dict, path or TargetInfo; then `tensors` must also hold
        embed_tokens.weight and lm_head.weight). The library copies the arrays."""
        if (target_config is None) == (target is None):
            raise ValueError("give exactly one of target_config (the target's config) or target (a pydflash.Target)")
        backend, device, target_info = _placement(target, target_config, backend, device, stream)
        config = config if isinstance(config, DrafterConfig) else DrafterConfig.from_json(config)
        config.check_target(target_info)
        expected = _expected_shapes(config, target_info, target)
        given = {}
        for name, value in tensors.items():
            canonical = name[len("model."):] if name.startswith("model.") else name
            if target is not None and canonical in _TARGET_TENSORS:
                continue  # shared with the target, as from_pretrained
            given[canonical] = as_tensor(name, value)
        try:
            checked = check_tensors(expected, given, "tensors")
        except CheckpointError as e:
            raise CheckpointError(f"tensors do not match the drafter config: {e}") from None
        return cls._create(config, target_info, checked, target, backend, device, stream, max_batch, max_seq_len,
                           ctx_window, ctx_chunk_rows)

    @classmethod
    def _create(cls, config, target_info, tensors, target, backend, device, stream, max_batch, max_seq_len,
                ctx_window, ctx_chunk_rows):
        lib = _ffi.load()
        code = backend_code(lib, backend)
        params = config.to_params(lib.ffi, lib.lib, target=target_info, max_batch=max_batch, max_seq_len=max_seq_len,
                                  ctx_window=ctx_window, ctx_chunk_rows=ctx_chunk_rows)
        if target is not None:
            context, handle = create_native(lib, "drafter", params, tensors, target_handle=target._live())
        else:
            context, handle = create_native(lib, "drafter", params, tensors,
                                            context_params=context_params(lib, code, device, stream))
        return cls(lib, context, handle, config, target_info, str(backend).lower(), device, target=target,
                   max_seq_len=max_seq_len)

    def new_sequence(self, budget_tokens=None) -> Sequence:
        """A sequence for positions [0, budget_tokens) (None: max_seq_len). KV blocks are taken as rows arrive."""
        return self._new_sequence(budget_tokens)

    def __repr__(self):
        state = "closed" if self.closed else f"{self.backend}:{self.device}"
        return (f"<pydflash.Drafter {state} layers={self.config.num_layers} hidden={self.hidden_size} "
                f"block_size={self.block_size}>")



def _placement(target, target_source, backend, device, stream):
    """(backend, device, TargetInfo): a Target's own (backend / device / stream must then be left unset or
    agree), or the given ones (host, device 0 by default) with the TargetInfo read from target_source."""
    if target is None:
        info = target_source if isinstance(target_source, TargetInfo) else TargetInfo.from_json(target_source)
        return ("host" if backend is None else backend), (0 if device is None else device), info
    if not hasattr(target, "_live") or not hasattr(target, "config") or not hasattr(target.config, "info"):
        raise TypeError(f"target must be a pydflash.Target, got {type(target).__name__}")
    for name, given, own in (("backend", backend, target.backend), ("device", device, target.device)):
        if given is not None and str(given).lower() != str(own):
            raise ValueError(f"{name}={given!r} differs from the target's {own!r} (a drafter made with "
                             f"target= runs where its target runs)")
    if stream is not None:
        raise ValueError("stream cannot be given with target= (the drafter uses the target's stream)")
    return target.backend, target.device, target.config.info


def _expected_shapes(config, target_info, target):
    """{name: shape} the drafter is given: all of config.tensor_shapes but the target's shared tensors when
    made with target= (shared in memory, never given)."""
    expected = config.tensor_shapes(target_info)
    if target is not None:
        expected = {k: v for k, v in expected.items() if k not in _TARGET_TENSORS}
    return expected

def _gather_tensors(draft_dir, target_dir, expected):
    """{canonical name: Tensor} for exactly the `expected` names, or ONE CheckpointError listing every missing,
    unexpected and misshaped tensor (the library validates again; this message is the readable one).
    embed_tokens / lm_head come from target_dir when `expected` holds them (a standalone drafter)."""
    tensors, problems = {}, []
    for name, tensor in load_tensors(draft_dir).items():
        canonical = name[len("model."):] if name.startswith("model.") else name  # the library accepts both
        if canonical in tensors:
            problems.append(f"{name} duplicates {tensors[canonical].name}")
        tensors[canonical] = tensor
    # embed_tokens / lm_head always come from the target, as in dflash.model; in the drafter file they are extra.
    unexpected = sorted(set(tensors) - (set(expected) - set(_TARGET_TENSORS)))
    if unexpected:
        problems.append(f"unexpected in {draft_dir}: {', '.join(unexpected)}")

    wanted = {k: v for k, v in _TARGET_TENSORS.items() if k in expected}
    found = load_tensors(target_dir, names=[n for names in wanted.values() for n in names]) if wanted else {}
    for canonical, names in wanted.items():
        hit = next((found[n] for n in names if n in found), None)
        if hit is None:
            problems.append(f"{target_dir} has no {' / '.join(names)}")
        else:
            tensors[canonical] = hit

    missing = sorted(set(expected) - set(tensors) - set(wanted))
    if missing:
        problems.append(f"missing from {draft_dir}: {', '.join(missing)}")
    misshaped = [f"{n} {list(tensors[n].shape)} (expected {list(expected[n])})"
                 for n in sorted(expected) if n in tensors and tensors[n].shape != tuple(expected[n])]
    if misshaped:
        problems.append("misshaped: " + ", ".join(misshaped))
    if problems:
        raise CheckpointError("checkpoint does not match the config: " + "; ".join(problems))
    return {name: tensors[name] for name in expected}  # with target=, not the drafter file's embed_tokens / lm_head
