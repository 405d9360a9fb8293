#!/usr/bin/env bash
# carry_wheels.sh: fetch (here, where pip reaches a registry) the Python wheels the H200 device
# image lacks, into build/whl/, for tools/gpu_check.sh to install there without a network.
#
#   tools/carry_wheels.sh            # idempotent: a wheel already in build/whl/ is not fetched again
#
# Then name build/whl in the device tool's `carry` (build/ is git-ignored, so it does not travel
# by itself). The device image has Python 3.12, numpy, safetensors, ml_dtypes, cuda-bindings,
# torch and transformers, but no cffi (pydflash's loader) and no pycparser (cffi's parser), and
# not the reference `dflash` package that tests/oracle.py imports (pure Python, installed there
# with --no-deps: its pinned extras are never imported by the model code).
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=build/whl
mkdir -p "$DEST"

# name==version: one version of each, or `pip install --no-index` there refuses the set.
WHEELS=(cffi==2.0.0 pycparser dflash==0.1.0)

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)

for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    # Wheel file names spell the project with underscores and keep its case loosely.
    pattern=$(echo "$name" | tr '[:upper:]-' '[:lower:]_')
    existing=$(ls "$DEST" 2>/dev/null | tr '[:upper:]' '[:lower:]' | grep -E "^${pattern}-[0-9]" || true)
    if [[ -n "$existing" ]]; then
        if [[ $(echo "$existing" | wc -l) -gt 1 ]]; then
            echo "carry_wheels: more than one $name wheel in $DEST; remove all but one:" >&2
            echo "$existing" >&2
            exit 1
        fi
        echo "carry_wheels: have $existing"
        continue
    fi
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" -d "$DEST" "$spec"
    echo "carry_wheels: fetched $(ls "$DEST" | grep -i "^${pattern}-")"
done

du -sh "$DEST" | awk '{print "carry_wheels: " $2 " holds " $1 " (counts towards the 64 MiB the device tool carries)"}'
