import functools
import inspect
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # so tests can `import oracle`

import make_checkpoint  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped when none is found)")
    config.addinivalue_line("markers", "slow: long-running")


@functools.lru_cache(maxsize=None)
def _cuda_devices():
    """(count, why): imported lazily so CPU-only machines need no CUDA bindings; any failure counts as none."""
    try:
        from cuda.bindings import runtime

        err, count = runtime.cudaGetDeviceCount()
        if err != runtime.cudaError_t.cudaSuccess:
            return 0, f"cudaGetDeviceCount: {err.name}"
        return count, f"{count} CUDA device(s)"
    except Exception as e:  # missing bindings, no driver, ...
        return 0, f"cudaGetDeviceCount failed: {type(e).__name__}: {e}"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    count, why = _cuda_devices()
    if count >= 1:
        return
    skip = pytest.mark.skip(reason=f"no CUDA device ({why})")
    for item in gpu_items:
        item.add_marker(skip)


_TARGET_ONLY = set(inspect.signature(make_checkpoint.make_target).parameters) - set(
    inspect.signature(make_checkpoint.make_drafter).parameters)
_BOTH = {"dtype", "shards"}


@pytest.fixture(scope="session")
def make_pair(tmp_path_factory):
    """make_pair(seed, **kwargs) -> (target_dir, draft_dir), cached per (seed, kwargs) for the session.

    Routing of kwargs: `target_<name>` goes to make_target as <name>; names only make_target takes (vocab_size,
    hidden_size, tie_word_embeddings, max_position_embeddings, eos_token_id) go to the target; dtype and shards go
    to both; everything else goes to make_drafter. The target is seeded with `seed`, the drafter with seed + 1.
    """
    cache = {}

    def make(seed, **kwargs):
        key = (seed, json.dumps(kwargs, sort_keys=True, default=str))
        if key in cache:
            return cache[key]
        target_kw, draft_kw = {"seed": seed}, {"seed": seed + 1}
        for name, value in kwargs.items():
            if name.startswith("target_") and name != "target_layer_ids":
                target_kw[name[len("target_"):]] = value
            elif name in _TARGET_ONLY:
                target_kw[name] = value
            elif name in _BOTH:
                target_kw[name] = draft_kw[name] = value
            else:
                draft_kw[name] = value
        root = tmp_path_factory.mktemp(f"pair{seed}_")
        target_dir = make_checkpoint.make_target(str(root / "target"), **target_kw)
        draft_dir = make_checkpoint.make_drafter(str(root / "draft"), target_dir=target_dir, **draft_kw)
        cache[key] = (target_dir, draft_dir)
        return cache[key]

    return make
