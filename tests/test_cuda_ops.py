"""Every cuda op against the host backend: runs the C++ harness tests/cuda/test_ops.cpp.

The harness (see its header) compares each op of the cuda backend with the host backend on random inputs with
awkward sizes, poisoned outputs and a tolerance per dtype, and prints "ALL OK". It is compiled against the
library's internal sources, so it is a CMake target of its own (DFLASH_OP_TESTS=ON), not part of the wheel.

Binary: $DFLASH_TEST_OPS, else <repo>/build/gpu/test_ops (where tools/gpu_check.sh builds it), else it is built
here with CMake into build/gpu (sm architectures from $DFLASH_CUDA_ARCHITECTURES, default "native").
Seed: $DFLASH_TEST_SEED (test_ops prints the seed it used either way).
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD_DIR = REPO / "build" / "gpu"

pytestmark = pytest.mark.gpu


def _build_test_ops():
    if shutil.which("cmake") is None or (shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists()):
        pytest.skip("test_ops is not built and cmake/nvcc are missing: set DFLASH_TEST_OPS or run tools/gpu_check.sh")
    env = dict(os.environ)
    env["PATH"] = "/usr/local/cuda/bin:" + env.get("PATH", "")
    arch = env.get("DFLASH_CUDA_ARCHITECTURES", "native")
    configure = ["cmake", "-S", str(REPO), "-B", str(BUILD_DIR), "-DDFLASH_CUDA=ON", "-DDFLASH_OP_TESTS=ON",
                 f"-DDFLASH_CUDA_ARCHITECTURES={arch}", "-DCMAKE_BUILD_TYPE=Release"]
    build = ["cmake", "--build", str(BUILD_DIR), "--target", "test_ops", "-j", str(os.cpu_count() or 4)]
    for cmd in (configure, build):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            pytest.fail(f"building test_ops failed: {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return BUILD_DIR / "test_ops"


@pytest.fixture(scope="module")
def test_ops_binary():
    env = os.environ.get("DFLASH_TEST_OPS")
    if env:
        path = Path(env)
        if not (path.is_file() and os.access(path, os.X_OK)):
            pytest.fail(f"DFLASH_TEST_OPS={env!r} is not an executable file")
        return path
    path = BUILD_DIR / "test_ops"
    if path.is_file() and os.access(path, os.X_OK):
        return path
    return _build_test_ops()


def _run(binary, *args, timeout):
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    print(output)  # shown by pytest on failure (and with -s)
    if proc.returncode == 77:
        pytest.skip("test_ops: " + (output.strip().splitlines() or ["no CUDA device"])[-1])
    assert proc.returncode == 0 and "ALL OK" in output, (
        f"test_ops {' '.join(args)} exited {proc.returncode}; last lines:\n" + "\n".join(output.splitlines()[-40:]))


def test_cuda_ops_smoke(test_ops_binary):
    """A few small cases of every op (seconds)."""
    _run(test_ops_binary, "--smoke", timeout=300)


def test_cuda_ops(test_ops_binary):
    """Every op at every size the harness lists (default level)."""
    _run(test_ops_binary, timeout=900)
