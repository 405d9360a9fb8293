"""What Drafter / Target and their sequences share as Python handles over native dflash objects.

The C API names each object's calls after its kind: dflash_<kind>_create / _set_tensor / _finalize / _destroy /
_pool_stats, and for its sequences dflash_<kind>_seq_alloc / _seq_free, with kind "drafter" or "target". The
classes here are bases: Drafter / Sequence and Target / TargetSequence add their own calls, docs and repr.
"""

import numpy as np

from .devices import stream_handle


def struct_dict(ffi, cdata):
    """Every field of a stats/info struct but struct_size, so the dict follows the header as it grows."""
    return {name: getattr(cdata, name) for name, _ in ffi.typeof(cdata[0]).fields if name != "struct_size"}


def new_struct(ffi, ctype):
    out = ffi.new(ctype + " *")
    out.struct_size = ffi.sizeof(ctype)
    return out


def backend_code(lib, backend):
    """'host' / 'cuda' -> the dflash_backend value, or a ValueError."""
    codes = {"host": lib.lib.DFLASH_BACKEND_HOST, "cuda": lib.lib.DFLASH_BACKEND_CUDA}
    code = codes.get(str(backend).lower())
    if code is None:
        raise ValueError(f"backend must be 'host' or 'cuda', got {backend!r}")
    return code


def context_params(lib, backend, device, stream):
    """A filled `dflash_context_params *` (cffi-owned) for a context of its own; backend a dflash_backend value."""
    params = lib.ffi.new("dflash_context_params *", lib.lib.dflash_context_default_params())
    params.backend, params.device = backend, device
    params.stream = stream_handle(stream)
    return params


def create_native(lib, kind, params, tensors, *, context_params=None, target_handle=None):
    """Create a finalized dflash_<kind> from its params and {name: checkpoint Tensor}, set in sorted-name order.

    Given exactly one of context_params (a new context is made for it: dflash_<kind>_create) or target_handle (a
    live dflash_target whose context it shares: dflash_<kind>_create_for_target). Returns (context, handle),
    context None when shared. On any failure whatever was made is destroyed and the error propagates.
    """
    ffi, c = lib.ffi, lib.lib
    dtypes = {"F32": c.DFLASH_DTYPE_F32, "F16": c.DFLASH_DTYPE_F16, "BF16": c.DFLASH_DTYPE_BF16}
    context = handle = None
    try:
        out = ffi.new(f"dflash_{kind} **")
        if target_handle is not None:
            lib.check(getattr(c, f"dflash_{kind}_create_for_target")(target_handle, params, out))
        else:
            context_out = ffi.new("dflash_context **")
            lib.check(c.dflash_context_create(context_params, context_out))
            context = context_out[0]
            lib.check(getattr(c, f"dflash_{kind}_create")(context, params, out))
        handle = out[0]
        set_tensor = getattr(c, f"dflash_{kind}_set_tensor")
        for name in sorted(tensors):
            t = tensors[name]
            lib.check(set_tensor(handle, name.encode(), dtypes[t.dtype], len(t.shape),
                                 ffi.new("int64_t[]", list(t.shape)), ffi.from_buffer(t.array.view(np.uint8))))
        lib.check(getattr(c, f"dflash_{kind}_finalize")(handle))
    except BaseException:
        # Statuses ignored: the original error is the one to report, and both calls accept NULL.
        getattr(c, f"dflash_{kind}_destroy")(handle or ffi.NULL)
        c.dflash_context_destroy(context or ffi.NULL)
        raise
    return context, handle


class NativeSequence:
    """Base of a sequence handle (dflash_<kind>_seq) of an owner (a NativeModel), which keeps it in _sequences."""

    _what = "sequence"  # how _live's error names it

    def __init__(self, owner, handle):
        self._owner, self._handle = owner, handle

    @property
    def closed(self):
        return self._handle is None

    def _live(self):
        if self._handle is None:
            owner = self._owner
            raise ValueError(f"{self._what} is closed" + (f" (its {owner._kind} was closed)" if owner.closed else ""))
        return self._handle

    def close(self):
        """Free the sequence and its KV blocks. A no-op when already closed (or its drafter / target was)."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        owner = self._owner
        owner._sequences.discard(self)
        owner._lib.check(getattr(owner._lib.lib, f"dflash_{owner._kind}_seq_free")(handle))

    def _invalidate(self):  # the owner destroyed us along with itself
        self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<pydflash.{type(self).__name__} {'closed' if self.closed else 'open'}>"


class NativeModel:
    """Base of a dflash_<kind> handle, its context (None: shared with, and closed by, another object) and the
    sequences it made."""

    _kind = None  # "drafter" / "target"
    _sequence_class = None  # its NativeSequence subclass

    def __init__(self, lib, context, handle):
        self._lib, self._context, self._handle = lib, context, handle
        self._sequences = set()  # live sequences, so close() can mark them closed

    @property
    def closed(self):
        return self._handle is None

    def _live(self):
        if self._handle is None:
            raise ValueError(f"{self._kind} is closed")
        return self._handle

    def _new_sequence(self, budget_tokens):
        out = self._lib.ffi.new(f"dflash_{self._kind}_seq **")
        self._lib.check(getattr(self._lib.lib, f"dflash_{self._kind}_seq_alloc")(self._live(), budget_tokens or 0,
                                                                                  out))
        seq = self._sequence_class(self, out[0])
        self._sequences.add(seq)
        return seq

    def pool_stats(self) -> dict:
        """{total_blocks, free_blocks, block_size, blocks_per_sequence, live_sequences} of the KV pool."""
        out = new_struct(self._lib.ffi, "dflash_pool_stats")
        self._lib.check(getattr(self._lib.lib, f"dflash_{self._kind}_pool_stats")(self._live(), out))
        return struct_dict(self._lib.ffi, out)

    def close(self):
        """Destroy the drafter / target (and with it every sequence still open), then its context. Idempotent."""
        if self._handle is None:
            return
        for seq in self._sequences:
            seq._invalidate()
        self._sequences.clear()
        handle, context, self._handle, self._context = self._handle, self._context, None, None
        try:
            self._lib.check(getattr(self._lib.lib, f"dflash_{self._kind}_destroy")(handle))
        finally:
            if context is not None:  # a drafter made with target= shares the target's context, which it closes
                self._lib.check(self._lib.lib.dflash_context_destroy(context))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Last resort only (close() is the contract); never raise from a finalizer, even at interpreter exit.
        try:
            self.close()
        except Exception:
            pass
