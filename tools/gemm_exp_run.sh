#!/usr/bin/env bash
# gemm_exp_run.sh (on the device, after tools/gemm_exp_build.sh here and carry ["build/exp_carry"]): every
# packed gemm_chain_bench variant over the chain at 1 and 16 rows and each GEMM alone, one line per run:
#   variant | arguments | copy bandwidth, chain ms, TB/s, x floor, us per GEMM over the floor
# e.g. tools/gpu_check.sh --only-ops --no-sanitizer --ops-args "--quick --filter gemm" --then "bash tools/gemm_exp_run.sh"
set -u
mkdir -p /tmp/gemm_exp && tar xzf build/exp_carry/bins.tar.gz -C /tmp/gemm_exp
LOG=${OUT:-build}/gemm_exp.log
# GEMM_EXP_ARGS: the argument sets, ';'-separated (default below)
DEFAULT_ARGS="--rows 1;--rows 16;--rows 1 --only qkv;--rows 1 --only o_proj;--rows 1 --only gate_up;--rows 1 --only down;--rows 16 --only gate_up"
# GEMM_EXP_VARIANTS: the variants (tags, e.g. "fb8bb7e_0 tree_0") in the order to run them (default: all, by name)
VARIANTS=${GEMM_EXP_VARIANTS:-$(cd /tmp/gemm_exp && ls gemm_chain_bench_* | sed 's/^gemm_chain_bench_//')}
IFS=';' read -r -a sets <<< "${GEMM_EXP_ARGS:-$DEFAULT_ARGS}"
for args in "${sets[@]}"; do  # every variant at an argument set, then the next set: a cut-short run has them all
    for v in $VARIANTS; do
        bin=/tmp/gemm_exp/gemm_chain_bench_$v
        r=$(timeout 60 "$bin" $args --iters 30 2>&1 | grep -E "^copy|FAIL|rror" | sed -E 's/copy bandwidth ([0-9.]+) TB.s; chain ([0-9.]+) ms = ([0-9.]+) TB.s = ([0-9.]+)x the floor \(([0-9.]+) ms\); ([0-9.-]+) us per GEMM over the floor/bw \1 chain \2 ms \3 TB\/s \4x floor \5 over \6 us/')
        echo "$v | $args | $r" | tee -a "$LOG"
    done
done
