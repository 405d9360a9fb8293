#!/usr/bin/env bash
# ab_source.sh REV: packs revision REV's tree for gpu_check.sh --ab, so one device run can time this tree's
# library against REV's in the same process tree (bench.py --variants "default;DFLASH_LIBRARY=\$AB_LIBRARY"):
# no machine-to-machine spread (1-4% on the H200s) between the two sides.
#   tools/ab_source.sh main            # writes build/ab/src.tar.gz and build/ab/rev (carry ["build/whl", "build/ab"])
#   tools/ab_source.sh --prebuilt main # also builds REV's library here (nvcc, no GPU: 3-4 minutes on 2 cores) into
#                                      # build/ab/libdflash.so.xz, which gpu_check.sh --ab unpacks instead of building
#                                      # REV on the device (60-80 s of device time)
#   tools/gpu_check.sh --no-ops --no-pytest --no-sanitizer --ab --then \
#       "python3 -P tools/bench.py --variants 'default;DFLASH_LIBRARY=\$AB_LIBRARY' --rows verify,decode --iters 50"
# REV's C ABI (dflash.h) must equal this tree's: the Python side and the header are this tree's, only the library
# differs (pydflash refuses a library of another ABI version).
set -euo pipefail
PREBUILT=0
if [[ ${1:-} == --prebuilt ]]; then PREBUILT=1; shift; fi
REV=${1:?usage: ab_source.sh [--prebuilt] REV}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
HASH=$(git rev-parse --verify "$REV^{commit}")
if ! git diff --quiet "$HASH" -- native/include/dflash.h; then
    echo "ab_source: $REV's native/include/dflash.h differs from this tree's: not an A/B of one ABI" >&2
    exit 2
fi
mkdir -p build/ab
rm -f build/ab/libdflash.so.xz
git archive --format=tar.gz -o build/ab/src.tar.gz "$HASH" CMakeLists.txt native  # the library only
echo "$HASH $REV" > build/ab/rev
echo "ab_source: build/ab/src.tar.gz = $REV ($HASH), $(du -h build/ab/src.tar.gz | cut -f1)"
if (( PREBUILT )); then  # the build gpu_check.sh --ab would run on the device (Release, sm_90), here
    src=build/ab_work/src bld=build/ab_work/$HASH  # outside build/ab, which travels
    rm -rf "$src" && mkdir -p "$src" && tar xzf build/ab/src.tar.gz -C "$src"
    cmake -S "$src" -B "$bld" -G Ninja -DDFLASH_CUDA=ON -DDFLASH_CUDA_ARCHITECTURES=90-real \
        -DCMAKE_BUILD_TYPE=Release > /dev/null
    ninja -C "$bld" dflash > /dev/null
    xz -9 -c "$bld/libdflash.so" > build/ab/libdflash.so.xz
    rm -rf "$src"  # the build dir stays: a second call for the same REV is incremental
    echo "ab_source: build/ab/libdflash.so.xz = $REV's library, $(du -h build/ab/libdflash.so.xz | cut -f1) (carry build/ab)"
fi
