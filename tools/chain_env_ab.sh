#!/usr/bin/env bash
# chain_env_ab.sh (on the device, after a gpu_check build): build/gpu/gemm_chain_bench under several settings of
# the library's switches, alternated per round, one line per run:
#   round | setting | arguments | chain ms, TB/s, x the copy floor, us per GEMM over the floor
# CHAIN_VARIANTS: ';'-separated settings, each a ','-separated list of NAME=VALUE ("default": none)
# CHAIN_ARGS: ';'-separated argument sets (default: the chain at 1, 7 and 16 rows); CHAIN_ROUNDS (default 2)
# e.g. --then "CHAIN_VARIANTS='default;DFLASH_GEMM_X_RING=1' bash tools/chain_env_ab.sh"
set -u
BIN=${CHAIN_BIN:-build/gpu/gemm_chain_bench}
[[ -x $BIN ]] || cmake --build build/gpu --target gemm_chain_bench -j "$(nproc)" > /dev/null || exit 1
LOG=${OUT:-build}/chain_ab.log
IFS=';' read -r -a variants <<< "${CHAIN_VARIANTS:-default}"
IFS=';' read -r -a sets <<< "${CHAIN_ARGS:---rows 1;--rows 7;--rows 16}"
for ((round = 0; round < ${CHAIN_ROUNDS:-2}; ++round)); do
    order=("${variants[@]}")
    if (( round % 2 )); then  # alternate the order: no setting always runs first
        order=()
        for ((i = ${#variants[@]} - 1; i >= 0; --i)); do order+=("${variants[i]}"); done
    fi
    for args in "${sets[@]}"; do
        for v in "${order[@]}"; do
            envs=()
            [[ $v == default ]] || IFS=',' read -r -a envs <<< "$v"
            r=$(env "${envs[@]}" timeout 120 "$BIN" $args --iters 30 2>&1 | grep -E "^copy|FAIL|rror" |
                sed -E 's/copy bandwidth ([0-9.]+) TB.s; chain ([0-9.]+) ms = ([0-9.]+) TB.s = ([0-9.]+)x the floor \(([0-9.]+) ms\); ([0-9.-]+) us per GEMM over the floor/chain \2 ms \3 TB\/s \4x floor \5 ms, \6 us over/')
            echo "$round | $v | $args | $r" | tee -a "$LOG"
        done
    done
done
