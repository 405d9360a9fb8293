#!/usr/bin/env bash
# gpu_env_matrix.sh: one pytest selection of the GPU suite under several environment settings, a
# line of pass/fail counts per setting: which kill switch (DFLASH_PDL, DFLASH_GEMM_TILED,
# DFLASH_FUSED_SWIGLU, DFLASH_FUSED_QKV_ROPE, DFLASH_CUDA_GRAPHS: =0 turns each off) or knob
# (DFLASH_ATTN_FILL=N: attention aims at N blocks) makes a failure go away. For the device
# machine, after gpu_check.sh installed the package, e.g.
#   tools/gpu_check.sh --no-ops --no-sanitizer --lean --then \
#     'tools/gpu_env_matrix.sh -k "near_tie or graph_replays" "default" "DFLASH_PDL=0" "DFLASH_PDL=0,DFLASH_GEMM_TILED=0"'
# Each setting is "default" or a comma list of NAME=VALUE; a setting prefixed "san:TOOL:" runs the
# selection under compute-sanitizer --tool TOOL. Logs go to $OUT/logs/env_matrix/ (or ./build/).
set -uo pipefail
[[ ${1:-} == -k ]] || { echo "usage: $0 -k EXPR SETTING..." >&2; exit 2; }
K=$2; shift 2
LOG_DIR=${OUT:-build}/logs/env_matrix
mkdir -p "$LOG_DIR"
i=0 rc_all=0
for setting in "$@"; do
    i=$((i + 1))
    san=()
    if [[ $setting == san:* ]]; then
        tool=${setting#san:}; tool=${tool%%:*}; setting=${setting#san:"$tool":}
        san=(compute-sanitizer --tool "$tool" --error-exitcode 1 --print-limit 10 --report-api-errors no
             --target-processes all)
    fi
    envs=()
    [[ $setting == default ]] || IFS=, read -r -a envs <<< "$setting"
    log=$LOG_DIR/$i.log
    start=$SECONDS
    env "${envs[@]}" "${san[@]}" python3 -P -m pytest -m gpu -q -rf -p no:cacheprovider -k "$K" tests > "$log" 2>&1
    rc=$?
    (( rc )) && rc_all=1
    counts=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -1)
    errs=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
    printf '%-60s rc %d  %s %s (%d s)\n' "${san[*]:+${san[2]} }$setting" "$rc" "$counts" "$errs" $((SECONDS - start))
    grep -E "^FAILED|^E  +(Assertion|assert)" "$log" | head -6 | sed 's/^/    /'
done
exit $rc_all
