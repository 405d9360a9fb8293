#!/usr/bin/env bash
# prebuild.sh: build here (nvcc, no GPU needed) what tools/gpu_check.sh would otherwise build on the device: the
# package (sm_90 only) and test_ops / gemm_chain_bench, packed into build/prebuilt/bundle.tar.xz (about 3 MB: the
# three binaries hold the same kernels, which xz -9 stores once) and stamped with tools/source_hash.sh's hash of the
# sources they come from. Carry build/prebuilt (with build/whl) and gpu_check.sh's build stage unpacks it in
# place of its 61-79 s build, if and only if the device's tree hashes the same; otherwise it builds.
#
#   tools/prebuild.sh           # 2 cores: about 3 minutes from scratch (incremental after: build/prebuilt_build)
#   tools/prebuild.sh --probe   # also gemm_chain_bench with the phase probe (-DDFLASH_PHASE_PROBE=ON), which
#                               # gpu_check.sh puts at build/probe/gemm_chain_bench: about 4 minutes in all
set -euo pipefail
PROBE=0
[[ ${1:-} == --probe ]] && PROBE=1

cd "$(dirname "$0")/.."
OUT=build/prebuilt
BUILD_DIR=build/prebuilt_build
SITE=build/prebuilt_site
hash=$(tools/source_hash.sh)
if [[ -f $OUT/source_hash && $(cat "$OUT/source_hash") == "$hash" && -f $OUT/bundle.tar.xz &&
      ( $PROBE == 0 || -f $OUT/probe ) ]]; then
    echo "prebuild: $OUT is current ($hash)"
    exit 0
fi
rm -rf "$OUT" "$SITE"
mkdir -p "$OUT" "$SITE"
# The same build as gpu_check.sh's stage 2, with the same architectures.
DFLASH_CUDA_ARCHITECTURES=90-real python3 -m pip install -q --no-build-isolation --no-deps --upgrade \
    --target "$SITE" -C build-dir="$BUILD_DIR" -C cmake.define.DFLASH_CUDA=ON \
    -C cmake.define.DFLASH_OP_TESTS=ON -C cmake.define.DFLASH_CUDA_ARCHITECTURES=90-real .
mkdir -p "$SITE/gpu_bin"
cp "$BUILD_DIR/test_ops" "$BUILD_DIR/gemm_chain_bench" "$SITE/gpu_bin/"
if (( PROBE )); then  # the probe build of the usual device command (speed log), target gemm_chain_bench only
    cmake -S . -B build/prebuilt_probe -G Ninja -DDFLASH_OP_TESTS=ON -DDFLASH_PHASE_PROBE=ON \
        -DDFLASH_CUDA_ARCHITECTURES=90-real -DCMAKE_BUILD_TYPE=Release > /dev/null
    ninja -C build/prebuilt_probe gemm_chain_bench > /dev/null
    cp build/prebuilt_probe/gemm_chain_bench "$SITE/gpu_bin/gemm_chain_bench_probe"
fi
# The sources must not have changed while they were compiled.
if [[ $(tools/source_hash.sh) != "$hash" ]]; then
    echo "prebuild: the sources changed during the build; run it again" >&2
    exit 1
fi
# pydflash/models (the embedded default pair, 31 MB) is in the device's tree already: gpu_check copies it from there.
tar -C "$SITE" --exclude=pydflash/models --exclude=__pycache__ -cf - . | xz -9 > "$OUT/bundle.tar.xz"
echo "$hash" > "$OUT/source_hash"
if (( PROBE )); then touch "$OUT/probe"; fi
du -sh "$OUT" | sed 's/^/prebuild: carry build\/prebuilt (with build\/whl): /'
