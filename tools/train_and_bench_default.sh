#!/usr/bin/env bash
# train_and_bench_default.sh: the device half of issue 6, run by gpu_check.sh as its --then stage:
#
#   tools/gpu_check.sh ... --then "bash tools/train_and_bench_default.sh 420"
#
# 1. tools/train_default.sh BUDGET_S: corpus, target, drafter, held-out acceptance (torch), the pair packed as
#    $OUT/t/default_pair.tar.part* plus $OUT/t/train_log.json;
# 2. the trained pair copied into the installed pydflash (its models/default), so the default model is the
#    trained one (SKIP_TRAINING=1: no training; the pair the package already ships is benched);
# 3. `pydflash bench` on it, cuda and host: mean acceptance, acceptance per position, tokens/s and speedup over
#    autoregressive decoding, each output checked equal to that backend's autoregressive output (BENCH_BACKENDS,
#    default "cuda host"; BENCH_MAX_NEW, default 64, may list several lengths). JSON and plots go
#    to $LOGS (gpu_check packs them into logs/logs.tar.gz), the tables to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${1:-420}
shift || true  # the rest goes to train_default.py (e.g. --tiny for a CPU check of this script)
OUT_DIR=${OUT:-build/train_out}
LOGS=${LOGS:-$OUT_DIR}
mkdir -p "$OUT_DIR/t" "$LOGS"

train_rc=0
if [[ ${SKIP_TRAINING:-0} != 1 ]]; then
    OUT="$OUT_DIR/t" bash tools/train_default.sh "$BUDGET" "$@"
    train_rc=$?
fi
echo "train_and_bench_default: training exited $train_rc"

PAIR=/tmp/pydflash_train/pair
SITE_PKG=$(python3 -P -c 'import os, pydflash; print(os.path.dirname(pydflash.__file__))')
if [[ ${SKIP_TRAINING:-0} == 1 ]]; then train_rc=0; fi  # (a re-run of the bench half on a trained pair)
if [[ -f $PAIR/draft/model.safetensors && -f $PAIR/prompts.json ]]; then
    rm -rf "$SITE_PKG/models/default"
    mkdir -p "$SITE_PKG/models/default"
    cp -r "$PAIR/target" "$PAIR/draft" "$PAIR/prompts.json" "$SITE_PKG/models/default/"
elif [[ ${SKIP_TRAINING:-0} == 1 && -f $SITE_PKG/models/default/draft/model.safetensors ]]; then
    echo "train_and_bench_default: benching the pair the installed package ships ($SITE_PKG/models/default)"
else
    echo "train_and_bench_default: no trained pair in $PAIR; nothing to bench"
    exit 1
fi
export XDG_CACHE_HOME=/tmp/pydflash_cache
rc=0
plot=()
for max_new in ${BENCH_MAX_NEW:-64}; do
for backend in ${BENCH_BACKENDS:-cuda host}; do
    echo "=== pydflash bench --backend $backend --max-new-tokens $max_new (trained default pair, its held-out prompts)"
    name=default_bench_$backend$( [[ $max_new == 64 ]] || echo "_$max_new" )
    python3 -P -c 'import matplotlib' 2>/dev/null && plot=(--plot "$LOGS/$name.png")
    python3 -P -m pydflash.cli bench --backend "$backend" --max-new-tokens "$max_new" --json "${plot[@]}" \
        > "$LOGS/$name.json" || rc=1
    python3 - "$LOGS/$name.json" <<'EOF' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("backend", "block_size", "mean_acceptance_length", "spec_tokens_per_second", "ar_tokens_per_second",
        "speedup", "same_output", "num_prompts")
print({k: r.get(k) for k in keys})
print("acceptance rate by position:", [round(x, 3) for x in r.get("acceptance_rate_by_position", [])])
EOF
done
done
exit $(( train_rc || rc ))
