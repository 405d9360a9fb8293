#!/usr/bin/env bash
# source_hash.sh: one sha256 over the files a gpu_check build compiles or installs (the library, the package,
# test_ops, gemm_chain_bench and the build files), by content and path; what tools/prebuild.sh stamps and
# tools/gpu_check.sh compares. Works on a copy of the tree without .git (the device's).
set -euo pipefail

cd "$(dirname "$0")/.."
# What .gitignore keeps out of the device's copy is left out here too (caches, objects, the installed library).
find native pydflash tests/cuda tools/gemm_chain_bench.cpp CMakeLists.txt pyproject.toml \
        -type f ! -path '*/__pycache__/*' ! -path '*/.pytest_cache/*' ! -path '*.egg-info/*' ! -name '*.pyc' \
        ! -name '*.so' ! -name '*.o' ! -path 'pydflash/lib/*' -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
