"""Zero-copy safetensors loading: HF checkpoint directory -> {name: Tensor} over read-only memory maps.

safetensors' own numpy loader copies every tensor and needs ml_dtypes for BF16. Here `safe_open` only validates
each file (it rejects bad offsets, truncation and absurd header lengths); the offsets are then read from the
header and the bytes mapped, so a BF16 tensor stays BF16 (as uint16 bit patterns) and nothing is read from disk
until the library copies it.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Stored dtype -> numpy view. BF16 has no numpy dtype without ml_dtypes: its bits are viewed as uint16.
DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file is missing, malformed or inconsistent; the message names the file and tensor."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # "F32" | "F16" | "BF16"
    shape: tuple
    array: np.ndarray  # read-only view of the file; uint16 bit patterns for BF16
    file: str


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:  # json.loads would silently keep the last one
        raise CheckpointError(f"duplicate tensor names in one header: {', '.join(dupes)}")
    return dict(pairs)


def _validated_header(path):
    """The header of one .safetensors file, after safetensors itself accepted the file."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            names = set(f.keys())
    except Exception as e:  # SafetensorError, OSError: the library's message says what was wrong
        raise CheckpointError(f"{path}: not a valid safetensors file: {e}") from e
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length), object_pairs_hook=_no_duplicate_keys)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    header.pop("__metadata__", None)
    if set(header) != names:  # cannot happen for a file safe_open accepted, unless the format changes
        raise CheckpointError(f"{path}: header names disagree with safetensors' view of the file")
    return header, 8 + length


def _map_file(path, header, data_start, names=None):
    """{name: Tensor} for the tensors of one file (all, or those in `names`)."""
    wanted = [n for n in header if names is None or n in names]
    for name in wanted:
        if header[name]["dtype"] not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {header[name]['dtype']}; "
                                  f"supported: {', '.join(DTYPES)}")
    if not wanted:
        return {}
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name in wanted:
        info = header[name]
        dtype, shape = DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"])
        begin, end = (data_start + int(o) for o in info["data_offsets"])
        if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes, not {shape} x {info['dtype']}")
        array = mapped[begin:end].view(dtype).reshape(shape)
        out[name] = Tensor(name, info["dtype"], shape, array, str(path))
    return out


def load_tensors(directory, names=None) -> dict:
    """Map the tensors of an HF checkpoint directory: `model.safetensors`, or the shards listed in
    `model.safetensors.index.json`. With `names`, only those tensors are mapped (and only the shards that hold
    them opened); names the checkpoint lacks are simply absent from the result.
    """
    directory = Path(directory)
    names = None if names is None else set(names)
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        single = directory / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")
        return _map_file(single, *_validated_header(single), names)

    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: unreadable index ({type(e).__name__}: {e})") from None
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        raise CheckpointError(f"{index_path}: listed shards missing: {', '.join(missing)}")
    if names is not None:
        shards = sorted({weight_map[n] for n in names if n in weight_map})

    headers = {shard: _validated_header(directory / shard) for shard in shards}
    found_in = {}
    for shard, (header, _) in headers.items():
        for name in header:
            if name in found_in:
                raise CheckpointError(f"tensor {name!r} is in both {directory / found_in[name]} and "
                                      f"{directory / shard}")
            found_in[name] = shard
    out = {}
    for shard, (header, data_start) in headers.items():
        path = directory / shard
        listed = {n for n, s in weight_map.items() if s == shard}
        stray = sorted(set(header) - listed)
        if stray:
            raise CheckpointError(f"{path}: holds {', '.join(stray)} which {INDEX_FILE} does not place there")
        absent = sorted(listed - set(header))
        if absent:
            raise CheckpointError(f"{path}: lacks {', '.join(absent)} which {INDEX_FILE} places there")
        out.update(_map_file(path, header, data_start, names))
    return out


def as_tensor(name, value) -> Tensor:
    """A Tensor from a Tensor (kept) or a C-contiguous numpy array: float32 -> F32, float16 -> F16, ml_dtypes
    bfloat16 -> BF16 (bf16 bit patterns as uint16 must come wrapped in a Tensor with dtype "BF16")."""
    if isinstance(value, Tensor):
        return value
    if not isinstance(value, np.ndarray):
        raise TypeError(f"tensor {name}: expected a numpy array or pydflash.Tensor, got {type(value).__name__}")
    kinds = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
    dtype = kinds.get(value.dtype.name)
    if dtype is None:
        raise TypeError(f"tensor {name}: dtype {value.dtype} is not float32, float16 or bfloat16 (give bf16 bit "
                        f"patterns as pydflash.Tensor(name, 'BF16', shape, uint16_array, '<memory>'))")
    array = np.ascontiguousarray(value)
    bits = array.view(np.uint16) if dtype == "BF16" else array
    return Tensor(name, dtype, tuple(array.shape), bits, "<memory>")


def check_tensors(expected, tensors, where) -> dict:
    """{name: Tensor} in `expected`'s order, or ONE CheckpointError naming every missing, unexpected and misshaped
    tensor. `expected` maps canonical names to shapes; `where` names the source in the message."""
    problems = []
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        problems.append(f"unexpected in {where}: {', '.join(unexpected)}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        problems.append(f"missing from {where}: {', '.join(missing)}")
    misshaped = [f"{n} {list(tensors[n].shape)} (expected {list(expected[n])})"
                 for n in sorted(expected) if n in tensors and tuple(tensors[n].shape) != tuple(expected[n])]
    if misshaped:
        problems.append("misshaped: " + ", ".join(misshaped))
    if problems:
        raise CheckpointError("; ".join(problems))
    return {name: tensors[name] for name in expected}
