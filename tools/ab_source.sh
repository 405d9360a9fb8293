#!/usr/bin/env bash
# ab_source.sh REV: packs revision REV's tree for gpu_check.sh --ab, so one device run can time this tree's
# library against REV's in the same process tree (bench.py --variants "default;DFLASH_LIBRARY=\$AB_LIBRARY"):
# no machine-to-machine spread (1-4% on the H200s) between the two sides.
#   tools/ab_source.sh main            # writes build/ab/src.tar.gz and build/ab/rev (carry ["build/whl", "build/ab"])
#   tools/gpu_check.sh --no-ops --no-pytest --no-sanitizer --ab --then \
#       "python3 -P tools/bench.py --variants 'default;DFLASH_LIBRARY=\$AB_LIBRARY' --rows verify,decode --iters 50"
# REV's C ABI (dflash.h) must equal this tree's: the Python side and the header are this tree's, only the library
# differs (pydflash refuses a library of another ABI version).
set -euo pipefail
REV=${1:?usage: ab_source.sh REV}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
HASH=$(git rev-parse --verify "$REV^{commit}")
if ! git diff --quiet "$HASH" -- native/include/dflash.h; then
    echo "ab_source: $REV's native/include/dflash.h differs from this tree's: not an A/B of one ABI" >&2
    exit 2
fi
mkdir -p build/ab
git archive --format=tar.gz -o build/ab/src.tar.gz "$HASH" CMakeLists.txt native  # the library only
echo "$HASH $REV" > build/ab/rev
echo "ab_source: build/ab/src.tar.gz = $REV ($HASH), $(du -h build/ab/src.tar.gz | cut -f1)"
