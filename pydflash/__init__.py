"""pydflash: DFlash block-diffusion speculative decoding on libdflash (C ABI in native/include/dflash.h).

    target = pydflash.Target.from_pretrained(target_dir)
    drafter = pydflash.Drafter.from_pretrained(draft_dir, target=target)
    result = pydflash.generate(target, drafter, prompt_ids, max_new_tokens=64)

Importing pydflash does not open the library; the first Target or Drafter (or _ffi.load()) does.
"""

from ._ffi import DflashError
from .checkpoint import CheckpointError, Tensor, load_tensors
from .config import DrafterConfig, RopeConfig, TargetConfig, TargetInfo
from .devices import cuda_devices, stream_handle
from .drafter import Drafter, Sequence
from .generate import GenerationResult, generate
from .sampling import SamplingParams
from .target import Target, TargetSequence
from .tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer

__all__ = ["ByteTokenizer", "CheckpointError", "DflashError", "Drafter", "DrafterConfig", "GenerationResult",
           "HFTokenizer", "RopeConfig", "SamplingParams", "Sequence", "Target", "TargetConfig", "TargetInfo",
           "TargetSequence", "Tensor", "TokenizerError", "cuda_devices", "generate", "load_tensors", "load_tokenizer",
           "stream_handle"]
