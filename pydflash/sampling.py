"""SamplingParams: how the target and the drafter choose tokens (dflash_sampling_params).

Validation follows dflash.model._validate_sampling (temperature >= 0, top_p in (0, 1], top_k >= 0), plus what C
cannot represent or what would silently mean something else (NaN, a seed outside uint64, an unknown draft mode).
"""

import functools
import math
from dataclasses import dataclass

DRAFT_MODES = ("greedy", "sample")  # the order of enum dflash_draft_mode


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy everywhere (the other fields are then ignored).

    draft_mode "greedy": the drafter proposes its argmax and verification treats the proposal as one-hot, which
    keeps blocks coherent and the output still distributed exactly as the target's sampler. "sample": each draft
    is drawn independently from the drafter's own temperature/top-p/top-k distribution, as dflash.model does.
    Random numbers are counter-based (keyed by seed and a per-sequence counter): a run is reproducible from its
    seed on every backend.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    draft_mode: str = "greedy"

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        # The reference's rule and message (dflash.model._validate_sampling), with the offending values.
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature and top_k must be non-negative, and top_p in (0, 1]; got "
                             f"temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}")
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite")
        if self.top_k > 2**31 - 1:
            raise ValueError(f"top_k {self.top_k} does not fit int32")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {', '.join(DRAFT_MODES)}, got {self.draft_mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_c(self, lib):
        """A cffi-owned `dflash_sampling_params *` for `lib` (an _ffi.Library)."""
        p = lib.ffi.new("dflash_sampling_params *", lib.lib.dflash_sampling_default_params())
        p.temperature, p.top_p, p.top_k, p.seed = self.temperature, self.top_p, self.top_k, self.seed
        p.draft_mode = DRAFT_MODES.index(self.draft_mode)
        return p


@functools.lru_cache(maxsize=64)
def _c_struct(lib, sampling):
    # SamplingParams is frozen and hashable: one C struct per distinct setting, not one per step. The library only
    # reads it (a const pointer), so sharing it is safe.
    return sampling.to_c(lib)


def sampling_pointer(lib, sampling):
    """SamplingParams or None -> the `const dflash_sampling_params *` the C calls take (NULL = greedy)."""
    if sampling is None:
        return lib.ffi.NULL
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a pydflash.SamplingParams or None, got {type(sampling).__name__}")
    return _c_struct(lib, sampling)
