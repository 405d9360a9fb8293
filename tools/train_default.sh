#!/usr/bin/env bash
# Train the embedded default pair on the device: corpus, target, drafter, held-out acceptance, packed pair.
#
#   OUT=dir bash tools/train_default.sh [BUDGET_S] [train_default.py options...]
#
# BUDGET_S (default 420) is the wall-clock budget of the whole run, corpus included. Writes $OUT/train.log (this
# output), $OUT/train_log.json and $OUT/default_pair.tar.part*; see tools/README.md and tools/train_default.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/train_out}
mkdir -p "$OUT"
TRAIN_T0=$(date +%s.%N)
export OUT PYTHONUNBUFFERED=1 TRAIN_T0
# The reference `dflash` package, when carried (tools/carry_wheels.sh puts its wheel in build/whl), lets the run
# also compare dflash_generate with its own acceptance numbers; training does not need it.
if ls build/whl/dflash-*.whl >/dev/null 2>&1 && ! "${PYTHON:-python3}" -c "import dflash" 2>/dev/null; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --target /tmp/train_site build/whl/dflash-*.whl \
    && export PYTHONPATH=/tmp/train_site${PYTHONPATH:+:$PYTHONPATH}
fi
budget=${1:-420}
shift || true
"${PYTHON:-python3}" tools/train_default.py --out "$OUT" --budget-s "$budget" "$@" 2>&1 | tee "$OUT/train.log"
exit "${PIPESTATUS[0]}"
