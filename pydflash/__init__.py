"""pydflash: DFlash block-diffusion drafters on libdflash (C ABI in native/include/dflash.h).

Importing pydflash does not open the library; the first Drafter (or _ffi.load()) does.
"""

from ._ffi import DflashError
from .checkpoint import CheckpointError, Tensor, load_tensors
from .config import DrafterConfig, RopeConfig, TargetInfo
from .devices import cuda_devices, stream_handle
from .drafter import Drafter, Sequence

__all__ = ["CheckpointError", "DflashError", "Drafter", "DrafterConfig", "RopeConfig", "Sequence", "TargetInfo",
           "Tensor", "cuda_devices", "load_tensors", "stream_handle"]
