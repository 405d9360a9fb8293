"""Target and TargetSequence: Python handles over dflash_target / dflash_target_seq.

The target is the model being accelerated (Qwen3 dense or Llama). Its sequences prefill a prompt, verify blocks
of drafts (accepting, rejecting and choosing the bonus token inside the library: one small copy back per step),
capture the hidden states a drafter needs straight into the drafter's sequence, and roll back rows. As for the
drafter, the library owns every weight and KV byte; a target and its sequences must be used by one thread at a
time.
"""

import numpy as np

from . import _ffi
from ._handle import NativeModel, NativeSequence, backend_code, context_params, create_native, new_struct, \
    struct_dict
from .checkpoint import CheckpointError, as_tensor, check_tensors, load_tensors
from .config import TargetConfig
from .sampling import sampling_pointer

# Stored tensors transformers itself skips when loading (buffers of old checkpoints), never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def token_buffer(ffi, token_ids, what="token_ids"):
    """(int32_t[] cdata, count) from a list/tuple/1-D integer array. Only representability is checked here; the
    library checks ids against the vocabulary and says which one is out of range."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
            raise TypeError(f"{what} must be a 1-D integer array, got {token_ids.dtype} {list(token_ids.shape)}")
        token_ids = token_ids.tolist()
    elif isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"{what} must be a list of ints, got {type(token_ids).__name__}")
    try:
        return ffi.new("int32_t[]", [int(t) if isinstance(t, np.integer) else t for t in token_ids]), len(token_ids)
    except OverflowError:
        bad = next(t for t in token_ids if not -2**31 <= int(t) < 2**31)
        raise ValueError(f"{what}: token id {bad} does not fit int32") from None
    except TypeError:
        bad = next(t for t in token_ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)))
        raise TypeError(f"{what} must hold ints, got {type(bad).__name__} {bad!r}") from None


class TargetSequence(NativeSequence):
    """One sequence's target state: a paged causal KV cache in the target's pool. Made by Target.new_sequence."""

    _what = "target sequence"

    def __init__(self, target, handle):
        super().__init__(target, handle)
        self._target = target  # the owner by its own name
        ffi = target._lib.ffi
        self._accepted = ffi.new("int32_t *")
        self._next = ffi.new("int32_t *")

    @staticmethod
    def _drafter_handle(drafter_seq, what):
        if drafter_seq is None:
            return None
        live = getattr(drafter_seq, "_live", None)
        if live is None or not hasattr(drafter_seq, "_drafter"):
            raise TypeError(f"{what} must be a pydflash drafter Sequence (Drafter.new_sequence), got "
                            f"{type(drafter_seq).__name__}")
        return live()

    def prefill(self, token_ids, sampling=None, capture=None) -> int:
        """Append prompt tokens (positions length, length+1, ...) and return the next token, chosen from the last
        row with `sampling` (None: greedy). It is not appended: it anchors the next verify. With capture (a drafter
        Sequence whose next position is this sequence's length), the rows' hidden states after the drafter's
        target_layer_ids become its context rows, without leaving the device."""
        lib = self._target._lib
        tokens, n = token_buffer(lib.ffi, token_ids)
        capture_handle = self._drafter_handle(capture, "capture")
        lib.check(lib.lib.dflash_target_seq_prefill(self._live(), tokens, n, sampling_pointer(lib, sampling),
                                                    capture_handle or lib.ffi.NULL, self._next))
        return self._next[0]

    def verify(self, token_ids, sampling=None, drafter_seq=None) -> tuple:
        """Verify [anchor, *drafts] in one forward; returns (accepted, next_token). The anchor and the accepted
        drafts stay in the KV cache, the rest are rolled back; next_token is the target's own token after them (the
        bonus), the anchor of the next block. Greedy: longest prefix equal to the target's argmax. Sampling:
        rejection sampling against the proposal of `drafter_seq` (the Sequence that proposed these drafts; its
        after_verify(k) then commits the first k+1 rows' features), else a one-hot proposal."""
        lib = self._target._lib
        tokens, n = token_buffer(lib.ffi, token_ids)
        handle = self._drafter_handle(drafter_seq, "drafter_seq")
        lib.check(lib.lib.dflash_target_seq_verify(self._live(), tokens, n, sampling_pointer(lib, sampling),
                                                   handle or lib.ffi.NULL, self._accepted, self._next))
        return self._accepted[0], self._next[0]

    def rollback(self, n_rows):
        """Drop the newest n_rows tokens from the KV cache (a stop token inside an accepted block, a retry)."""
        lib = self._target._lib
        lib.check(lib.lib.dflash_target_seq_rollback(self._live(), n_rows))

    def info(self) -> dict:
        """{budget_tokens, length (tokens in the KV cache), blocks_held, steps}."""
        lib = self._target._lib
        out = new_struct(lib.ffi, "dflash_target_seq_stats")
        lib.check(lib.lib.dflash_target_seq_info(self._live(), out))
        return struct_dict(lib.ffi, out)

    def reset(self):
        """Return every KV block and restart at position 0, keeping the handle and budget."""
        lib = self._target._lib
        lib.check(lib.lib.dflash_target_seq_reset(self._live()))


class Target(NativeModel):
    """A Qwen3 / Llama target model on one backend. Create with Target.from_pretrained; free with close() / `with`.

    Drafters made with Drafter.from_pretrained(draft_dir, target=this) share its context, embed_tokens and
    lm_head; they keep the shared weights alive if the target is closed first.
    """

    _kind, _sequence_class = "target", TargetSequence

    def __init__(self, lib, context, handle, config, path, backend, device, sizing):
        super().__init__(lib, context, handle)
        self.config, self.path, self.backend, self.device = config, path, backend, device
        self.max_batch, self.max_seq_len, self.max_verify_rows, self.prefill_chunk = sizing

    @classmethod
    def from_pretrained(cls, target_dir, backend="host", device=0, *, max_batch=1, max_seq_len=4096,
                        max_verify_rows=16, prefill_chunk=None, stream=None) -> "Target":
        """Load a Qwen3ForCausalLM / LlamaForCausalLM checkpoint (HF layout: config.json + model.safetensors or
        sharded with an index). `max_seq_len` bounds one sequence (prompt + output); `max_verify_rows` the widest
        block a verify takes; `prefill_chunk` the prompt rows per forward in prefill (None: the library's default,
        512); `stream` a CUDA stream to enqueue on (None: the library makes one)."""
        config = TargetConfig.from_json(target_dir)
        return cls._create(config, _gather_tensors(target_dir, config), str(target_dir), backend, device, stream,
                           (max_batch, max_seq_len, max_verify_rows, prefill_chunk))

    @classmethod
    def from_tensors(cls, config, tensors, backend="host", device=0, *, max_batch=1, max_seq_len=4096,
                     max_verify_rows=16, prefill_chunk=None, stream=None) -> "Target":
        """A target from weights already in memory: `config` a TargetConfig, a config.json dict or path;
        `tensors` {name: numpy array (float32 / float16 / ml_dtypes bfloat16) or pydflash.Tensor}, named as in
        the checkpoint ("model." prefix optional). The library copies them; the arrays may be dropped after.
        Sizing and stream as from_pretrained."""
        config = config if isinstance(config, TargetConfig) else TargetConfig.from_json(config)
        given = {}
        for name, value in tensors.items():
            canonical = name[len("model."):] if name.startswith("model.") else name
            if config.tie_word_embeddings and canonical == "lm_head.weight":
                continue  # as from a checkpoint: the tied head is embed_tokens
            given[canonical] = as_tensor(name, value)
        try:
            checked = check_tensors(config.tensor_shapes(), given, "tensors")
        except CheckpointError as e:
            raise CheckpointError(f"tensors do not match the target config ({config.arch}): {e}") from None
        return cls._create(config, checked, "<memory>", backend, device, stream,
                           (max_batch, max_seq_len, max_verify_rows, prefill_chunk))

    @classmethod
    def _create(cls, config, tensors, path, backend, device, stream, sizing):
        lib = _ffi.load()
        code = backend_code(lib, backend)
        max_batch, max_seq_len, max_verify_rows, prefill_chunk = sizing
        params = config.to_params(lib.ffi, lib.lib, max_batch=max_batch, max_seq_len=max_seq_len,
                                  max_verify_rows=max_verify_rows, prefill_chunk=prefill_chunk)
        context, handle = create_native(lib, "target", params, tensors,
                                        context_params=context_params(lib, code, device, stream))
        sizing = (max_batch, max_seq_len, max_verify_rows, int(params.prefill_chunk))  # the chunk in effect
        return cls(lib, context, handle, config, path, str(backend).lower(), device, sizing)

    def new_sequence(self, budget_tokens=None) -> TargetSequence:
        """A sequence for positions [0, budget_tokens) (None: max_seq_len). KV blocks are taken as it grows."""
        return self._new_sequence(budget_tokens)

    def __repr__(self):
        state = "closed" if self.closed else f"{self.backend}:{self.device}"
        c = self.config
        return f"<pydflash.Target {state} {c.arch} layers={c.num_layers} hidden={c.hidden_size} vocab={c.vocab_size}>"


def _gather_tensors(target_dir, config):
    """{canonical name: Tensor} for exactly config.tensor_shapes(), or ONE CheckpointError listing every missing,
    unexpected and misshaped tensor."""
    expected = config.tensor_shapes()
    tensors, problems = {}, []
    for name, tensor in load_tensors(target_dir).items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        canonical = name[len("model."):] if name.startswith("model.") else name
        if config.tie_word_embeddings and canonical == "lm_head.weight":
            continue  # transformers ties the head to embed_tokens and ignores a stored copy
        if canonical in tensors:
            problems.append(f"{name} duplicates {tensors[canonical].name}")
        tensors[canonical] = tensor
    checked = None
    try:
        checked = check_tensors(expected, tensors, target_dir)
    except CheckpointError as e:
        problems.append(str(e))
    if problems:
        raise CheckpointError(f"target checkpoint does not match its config ({config.arch}): " + "; ".join(problems))
    return checked
