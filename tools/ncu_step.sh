#!/usr/bin/env bash
# ncu_step.sh ROW [COUNT] [KERNEL_REGEX]: Nsight Compute counters of the first COUNT kernels matching
# KERNEL_REGEX (default 6 of gemm_stream: one target layer's GEMMs) in one step of tools/bench.py's
# row ROW (bench.py --ncu-step opens a CUDA profiler range around one step after the warm-up).
# On the GPU machine, e.g. as gpu_check's --then (PYTHONPATH holds pydflash there):
#   tools/ncu_step.sh verify; tools/ncu_step.sh decode
# Writes $OUT/ncu_ROW.csv (ncu --page details, one row per kernel and metric) and ncu_ROW.log.
# Clocks are left alone (--clock-control none), as the device notes ask.
set -uo pipefail
ROW=${1:?usage: ncu_step.sh ROW [COUNT] [KERNEL_REGEX]}
COUNT=${2:-6}
KREGEX=${3:-gemm_stream}
OUT_DIR=${OUT:-build/ncu}
mkdir -p "$OUT_DIR"
REP=/tmp/ncu_$ROW
ncu --clock-control none --profile-from-start off -k "regex:$KREGEX" --launch-count "$COUNT" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats -f -o "$REP" \
    python3 -P tools/bench.py --rows "$ROW" --iters 1 --no-reference --ncu-step > "$OUT_DIR/ncu_$ROW.log" 2>&1
rc=$?
ncu --import "$REP.ncu-rep" --csv --page details > "$OUT_DIR/ncu_$ROW.csv" 2>> "$OUT_DIR/ncu_$ROW.log"
echo "ncu_step $ROW: rc $rc, $(wc -l < "$OUT_DIR/ncu_$ROW.csv") csv lines"
exit $rc
