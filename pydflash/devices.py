"""CUDA device discovery (cuda-python) and stream handles, without touching libdflash."""


def cuda_devices() -> list:
    """[{name, total_memory (bytes), compute_capability (major, minor)}] per visible device.

    [] when cuda-python is missing or there is no driver or device: discovery is informational and must never
    be the reason a host-only run fails.
    """
    try:
        from cuda.bindings import runtime

        err, count = runtime.cudaGetDeviceCount()
        if err != runtime.cudaError_t.cudaSuccess:
            return []
        devices = []
        for ordinal in range(count):
            err, prop = runtime.cudaGetDeviceProperties(ordinal)
            if err != runtime.cudaError_t.cudaSuccess:
                continue
            name = prop.name
            name = name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(name, bytes) else str(name)
            devices.append({"name": name, "total_memory": int(prop.totalGlobalMem),
                            "compute_capability": (int(prop.major), int(prop.minor))})
        return devices
    except Exception:
        return []


def stream_handle(stream) -> int:
    """A cudaStream_t as an integer for dflash_context_params.stream (0: the library creates its own).

    Accepts None, an int, a torch.cuda.Stream (`.cuda_stream`), a CuPy stream (`.ptr`) or a cuda-python
    cudaStream_t / CUstream (int()-able).
    """
    if stream is None:
        return 0
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            stream = getattr(stream, attr)
            break
    if isinstance(stream, bool):
        raise TypeError("a stream handle cannot be a bool")
    try:
        handle = int(stream)
    except (TypeError, ValueError):
        raise TypeError(f"cannot take a CUDA stream handle from {type(stream).__name__}") from None
    if not 0 <= handle < 1 << 64:
        raise ValueError(f"stream handle {handle} is not a pointer value")
    return handle
