#!/usr/bin/env bash
# gpu_check.sh: THE one command every session runs on the GPU (device) machine.
#
# It installs what the device image lacks (carried wheels), builds and installs the project for
# sm_90 (plus tests/cuda/test_ops), runs the cuda-vs-host op test, the GPU pytest suite, and
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over both, and leaves a summary.
#
# Use (from the development machine):
#   tools/carry_wheels.sh                       # once: cffi, pycparser, dflash wheels -> build/whl
#   device run: command = "tools/gpu_check.sh", carry = ["build/whl"], timeout_s = 600
# or a part of it:
#   tools/gpu_check.sh --quick                  # sanitizers over test_ops --quick + pytest -k smoke
#   tools/gpu_check.sh --no-sanitizer           # build, test_ops, pytest -m gpu
#   tools/gpu_check.sh --only-ops               # cmake build of test_ops, test_ops (+ its sanitizers)
#   tools/gpu_check.sh --only-ops --no-sanitizer --ops-args "--filter attention --full"
#
# Flags:
#   --quick              sanitizers run over test_ops --quick and `pytest -m gpu -k smoke` only
#   --no-sanitizer       skip compute-sanitizer
#   --only-ops           no pip install and no pytest: build test_ops with cmake, run it (+ sanitizers)
#   --no-pytest          skip the pytest stages (plain and sanitized)
#   --ops-sanitizers     sanitizers over test_ops only (the plain pytest stage still runs): about 2 minutes
#   --sanitizers LIST    comma list of compute-sanitizer tools (default memcheck,racecheck,initcheck,synccheck)
#   --ops-args "ARGS"    extra arguments for the plain test_ops run (e.g. "--full", "--filter gemm")
#   --ops-san-level L    test_ops level under the sanitizers: smoke | quick (default) | default
#   --pytest-args "ARGS" extra arguments for every pytest run, split as the shell splits words, quotes kept
#                        (e.g. "-k lifecycle", or "-k 'smoke or lossless'")
#   --no-ops             skip the test_ops stage (and its sanitizer runs)
#   --bench "ARGS"       after pytest, run tools/bench.py ARGS (issue 5's speed table; "" for its defaults),
#                        writing $OUT/bench.json, bench.png and logs/bench.log
#   --then "CMD"         after the bench, run CMD (bash -c, repo root, PYTHONPATH with pydflash) as stage "then"
#   --ab                 also build the library of build/ab/src.tar.gz (tools/ab_source.sh REV; carry build/ab), or
#                        unpack build/ab/libdflash.so.xz where ab_source.sh --prebuilt built it here, and
#                        export AB_LIBRARY (its libdflash.so) and AB_REV for --bench / --then, e.g. --then
#                        "python3 -P tools/bench.py --variants 'default;DFLASH_LIBRARY=\$AB_LIBRARY' --rows verify"
#   --lean               bring back fewer files (no summary.json, bench.png, logs/bench.log), leaving
#                        room under $OUT for what --then writes (the device tool returns at most 8)
#   --seed N             test_ops seed (default: the clock; printed and recorded either way)
# A carried build/prebuilt (tools/prebuild.sh, here) replaces the build stage when its sources hash the same
# (with --probe, it also leaves the phase probe's gemm_chain_bench at build/probe/gemm_chain_bench).
#   --budget S           seconds for the whole run (default 560, inside the device tool's 600 s per
#                        command): a stage that would start with under 20 s left is skipped, and every
#                        stage runs under `timeout` with what is left, so the summary is always written
#
# Sanitizer knobs (environment): SAN_WORKERS (pytest-xdist workers per tool, default 3),
# SAN_CYCLES (lifecycle cycles, 30), SAN_TRIALS (prompts per lossless case, 1), SAN_TOKENS (tokens
# per lossless prompt, 48), SAN_GRAPH_STEPS (graph-test steps, 10); racecheck: SAN_RACECHECK_WORKERS
# (3), SAN_RACECHECK_TOKENS (12), SAN_RACECHECK_GRAPHS=1 (keep graphs and the graph-replay test),
# SAN_RACECHECK_K (its pytest -k; default "not graph_replays"), e.g. to finish in a second run
#   SAN_RACECHECK_K="sampling or smoke or ten_thousand" tools/gpu_check.sh --no-ops --sanitizers racecheck
#
# Output (the device tool brings back at most 8 files from $OUT, 2 folders deep):
#   $OUT/summary.json    machine-readable: ok, stages (status, rc, seconds), test counts, sanitizer
#                        error counts, device memory before/after, device, seed
#   $OUT/summary.md      the same for people (paste it into issue notes)
#   $OUT/logs/gpu_check.log   everything this script printed
#   $OUT/logs/logs.tar.gz     every stage's own log (build, test_ops, pytest, each sanitizer run)
# Without $OUT (a local try) they go to ./build/gpu_check_out/.
# Exit status: 0 when every stage that ran passed, else 1. The summary is written after every stage.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"

QUICK=0 SANITIZE=1 ONLY_OPS=0 PYTEST=1 SAN_PYTEST=1 OPS=1 BENCH=0 BENCH_ARGS="" THEN="" LEAN=0 AB=0
SANITIZERS=memcheck,racecheck,initcheck,synccheck
OPS_ARGS="" OPS_SAN_LEVEL=quick PYTEST_ARGS="" SEED="" BUDGET=${GPU_CHECK_BUDGET:-560}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --no-sanitizer) SANITIZE=0 ;;
        --only-ops) ONLY_OPS=1; PYTEST=0 ;;
        --no-pytest) PYTEST=0 ;;
        --ops-sanitizers) SAN_PYTEST=0 ;;
        --no-ops) OPS=0 ;;
        --bench) BENCH=1; BENCH_ARGS=$2; shift ;;
        --then) THEN=$2; shift ;;
        --lean) LEAN=1 ;;
        --ab) AB=1 ;;
        --sanitizers) SANITIZERS=$2; shift ;;
        --ops-args) OPS_ARGS=$2; shift ;;
        --ops-san-level) OPS_SAN_LEVEL=$2; shift ;;
        --pytest-args) PYTEST_ARGS=$2; shift ;;
        --seed) SEED=$2; shift ;;
        --budget) BUDGET=$2; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown flag $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
SEED=${SEED:-$(date +%s)}

OUT_DIR=${OUT:-$REPO/build/gpu_check_out}
WORK=${WORK:-/tmp/dflash_gpu_check}
SITE=$WORK/site          # cffi, pycparser, pydflash
ORACLE=$WORK/oracle      # dflash (the reference), only if it imports with the image's torch/transformers
LOGS=$WORK/logs
BUILD=build/gpu
TEST_OPS=$REPO/$BUILD/test_ops
rm -rf "$LOGS" "$WORK/stages.jsonl"
mkdir -p "$OUT_DIR/logs" "$LOGS" "$SITE"
: > "$WORK/stages.jsonl"
exec > >(tee "$OUT_DIR/logs/gpu_check.log") 2>&1

export PATH=/usr/local/cuda/bin:$PATH
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
OVERALL_OK=1

# record NAME STATUS RC SECONDS LOG [KEY=VALUE ...]: one JSON line per stage (values stay strings;
# the summariser turns numeric ones into numbers).
record() {
    python3 - "$WORK/stages.jsonl" "$@" <<'EOF'
import json, sys
path, name, status, rc, secs, log, *extra = sys.argv[1:]
row = {"name": name, "status": status, "rc": int(rc) if rc.lstrip("-").isdigit() else None,
       "seconds": int(secs), "log": log}
for kv in extra:
    k, _, v = kv.partition("=")
    row[k] = v
with open(path, "a") as f:
    f.write(json.dumps(row) + "\n")
EOF
    # after every stage, so a run killed later still leaves its summary (parallel jobs: once, after)
    [[ ${IN_PARALLEL:-0} == 1 ]] || summarize "$ALL_ARGS"
}

gpu_memory() {  # "used,total" in MiB, or "" without nvidia-smi
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits 2>/dev/null \
        | head -1 | tr -d ' '
}

# run_stage NAME LOGFILE CMD...: runs CMD (a program, not a shell function) under the remaining
# budget, output to the console and LOGFILE. Sets STAGE_RC, STAGE_STATUS (ok / failed / timeout /
# skipped), STAGE_SECS and STAGE_NOTE (extra record fields) for the caller's `record`.
run_stage() {
    local name=$1 log=$2
    shift 2
    local left=$(( BUDGET - $(elapsed) ))
    STAGE_NOTE=""
    if (( left < 20 )); then
        echo "=== $name: SKIPPED (time budget: $(elapsed) s of $BUDGET s used)"
        STAGE_RC=-1 STAGE_STATUS=skipped STAGE_SECS=0 STAGE_NOTE=reason=budget
        return
    fi
    echo "=== $name  [t=$(elapsed) s, $left s left]: $*"
    local t0
    t0=$(date +%s)
    timeout -k 10 "$left" "$@" 2>&1 | tee "$log"
    STAGE_RC=${PIPESTATUS[0]}
    STAGE_SECS=$(( $(date +%s) - t0 ))
    STAGE_STATUS=ok
    if (( STAGE_RC == 77 )); then  # test_ops: no CUDA device
        STAGE_STATUS=skipped STAGE_NOTE=reason=no-cuda-device
    elif (( STAGE_RC == 124 || STAGE_RC == 137 )); then
        STAGE_STATUS=timeout STAGE_NOTE=reason=budget
    elif (( STAGE_RC != 0 )); then
        STAGE_STATUS=failed
    fi
    echo "=== $name: $STAGE_STATUS (rc $STAGE_RC, $STAGE_SECS s)"
}

summarize() {
    python3 - "$WORK/stages.jsonl" "$OUT_DIR" "$SEED" "$(elapsed)" "$OVERALL_OK" \
        "${MEM_BEFORE:-}" "${MEM_AFTER:-}" "${DEVICE_NAME:-}" "$*" <<'EOF'
import json, sys
stages_path, out, seed, secs, overall, mem_before, mem_after, device, flags = sys.argv[1:]
stages = [json.loads(l) for l in open(stages_path) if l.strip()]
def num(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return v
for s in stages:
    for k, v in list(s.items()):
        if k not in ("name", "status", "log"):
            s[k] = num(v)
def mem(v):
    if not v or "," not in v:
        return None
    used, total = v.split(",")[:2]
    return {"used_mib": num(used), "total_mib": num(total)}
by = {s["name"]: s for s in stages}
sanitizers = {}
for s in stages:
    if s["name"].startswith("sanitizer:"):
        _, tool, target = s["name"].split(":")
        sanitizers.setdefault(tool, {})[target] = {"status": s["status"], "errors": s.get("errors"),
                                                    "seconds": s["seconds"]}
def pick(name, *keys):
    s = by.get(name)
    return None if s is None else {k: s.get(k) for k in ("status", "seconds") + keys}
summary = {
    "ok": overall == "1",
    "seconds": int(secs),
    "seed": num(seed),
    "flags": flags,
    "device": device or None,
    "memory": {"before": mem(mem_before), "after": mem(mem_after)},
    "test_ops": pick("test_ops", "cases", "failed", "all_ok"),
    "pytest": pick("pytest", "passed", "failed", "skipped", "errors"),
    "sanitizers": sanitizers,
    "stages": stages,
}
if "lean=1" not in flags:
    json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)

md = [f"# gpu_check: {'PASS' if summary['ok'] else 'FAIL'}", "",
      f"- device: {device or 'unknown'}; flags: `{flags or '(none)'}`; test_ops seed {seed}; {secs} s", ""]
mb, ma = summary["memory"]["before"], summary["memory"]["after"]
if mb:
    md.append(f"- device memory used: {mb['used_mib']} MiB before, "
              f"{ma['used_mib'] if ma else '?'} MiB after (of {mb['total_mib']} MiB)")
t = summary["test_ops"]
if t:
    md.append(f"- test_ops: {t['status']}, {t.get('cases')} cases, {t.get('failed')} failed")
p = summary["pytest"]
if p:
    md.append(f"- pytest -m gpu: {p['status']}: {p.get('passed')} passed, {p.get('failed')} failed, "
              f"{p.get('skipped')} skipped, {p.get('errors')} errors")
if sanitizers:
    md += ["", "| sanitizer | test_ops errors | pytest errors |", "| --- | --- | --- |"]
    for tool, r in sanitizers.items():
        cell = lambda x: "-" if x is None else (f"{x['errors']} ({x['status']}, {x['seconds']} s)")
        md.append(f"| {tool} | {cell(r.get('test_ops'))} | {cell(r.get('pytest'))} |")
md += ["", "| stage | status | rc | seconds | log |", "| --- | --- | --- | --- | --- |"]
for s in stages:
    md.append(f"| {s['name']} | {s['status']} | {s.get('rc')} | {s['seconds']} | {s.get('log')} |")
open(f"{out}/summary.md", "w").write("\n".join(md) + "\n")
EOF
    # Individual logs travel as one archive (the device tool returns at most 8 files).
    tar -czf "$OUT_DIR/logs/logs.tar.gz" -C "$WORK" logs 2>/dev/null || true
}
# --pytest-args as words, with the shell's quoting ("-k 'a or b'" is two words, not four): parsed, never run.
PYTEST_WORDS=()
if [[ -n $PYTEST_ARGS ]]; then
    if ! mapfile -t PYTEST_WORDS < <(python3 -c 'import shlex, sys; print("\n".join(shlex.split(sys.argv[1])))' \
                                           "$PYTEST_ARGS") || (( ${#PYTEST_WORDS[@]} == 0 )); then
        echo "gpu_check: --pytest-args '$PYTEST_ARGS': not shell words" >&2
        exit 2
    fi
fi
ALL_ARGS="lean=$LEAN quick=$QUICK sanitize=$SANITIZE only_ops=$ONLY_OPS ops=$OPS bench=$BENCH ab=$AB bench_args='$BENCH_ARGS' then='$THEN' pytest=$PYTEST san_pytest=$SAN_PYTEST sanitizers=$SANITIZERS ops_args='$OPS_ARGS' ops_san_level=$OPS_SAN_LEVEL pytest_args='$PYTEST_ARGS' budget=$BUDGET"
trap 'summarize "$ALL_ARGS"' EXIT

fail_stage() { OVERALL_OK=0; }

# ------------------------------------------------------------------------------------------------
# 0. What machine is this
# ------------------------------------------------------------------------------------------------
DEVICE_NAME=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
echo "gpu_check: repo $REPO, out $OUT_DIR, work $WORK, seed $SEED, budget $BUDGET s"
echo "gpu_check: device: ${DEVICE_NAME:-none (nvidia-smi missing or no GPU)}"
{
    python3 --version
    nvcc --version | tail -2
    cmake --version | head -1
    python3 -c 'from importlib.metadata import version as v; print("torch", v("torch"), "transformers", v("transformers"))' 2>&1 | tail -1
    command -v compute-sanitizer || echo "compute-sanitizer: not found"
} 2>&1 | sed 's/^/gpu_check: /'

# ------------------------------------------------------------------------------------------------
# 1. Wheels the image lacks (tools/carry_wheels.sh put them in build/whl)
# ------------------------------------------------------------------------------------------------
PYPATH=$SITE
if (( ! ONLY_OPS )); then
    shopt -s nullglob
    wheels=() oracle_wheels=()
    for w in build/whl/*.whl; do
        case "$(basename "$w")" in dflash-*) oracle_wheels+=("$w") ;; *) wheels+=("$w") ;; esac
    done
    if (( ${#wheels[@]} )); then
        run_stage wheels "$LOGS/wheels.log" python3 -m pip install -q --no-index --no-deps --no-compile \
            --upgrade --target "$SITE" "${wheels[@]}"
        record wheels "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" wheels.log $STAGE_NOTE
        [[ $STAGE_STATUS == ok ]] || fail_stage
    else
        echo "gpu_check: no wheels in build/whl (run tools/carry_wheels.sh here and carry build/whl)"
        record wheels failed 1 0 - reason=no-wheels
        fail_stage
    fi
    # The reference package: only put on the path if it imports with this image's torch and
    # transformers, so that a version mismatch skips the oracle tests instead of breaking collection.
    if (( ${#oracle_wheels[@]} )); then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$ORACLE" \
            "${oracle_wheels[@]}" > "$LOGS/oracle.log" 2>&1
        if PYTHONPATH=$ORACLE python3 -c 'import dflash.model' >> "$LOGS/oracle.log" 2>&1; then
            PYPATH=$SITE:$ORACLE
            record oracle ok 0 0 oracle.log note=dflash.model-imports
        else
            echo "gpu_check: dflash.model does not import here (see oracle.log); oracle tests will skip"
            record oracle skipped 1 0 oracle.log note=dflash.model-import-failed
        fi
    fi
    shopt -u nullglob
fi

# ------------------------------------------------------------------------------------------------
# 2. Build: the package (pip, sm_90 only) and test_ops, sharing one CMake build in build/gpu
# ------------------------------------------------------------------------------------------------
export DFLASH_CUDA_ARCHITECTURES=90-real
# tools/prebuild.sh's build (carried as build/prebuilt) stands in for this one when it was built from the same
# sources (tools/source_hash.sh): unpacked instead of 61-79 s of nvcc. A stale one is ignored, and said so.
PREBUILT=build/prebuilt
PREBUILT_OK=0
if [[ -f $PREBUILT/source_hash && -f $PREBUILT/bundle.tar.xz ]]; then
    if [[ $(cat "$PREBUILT/source_hash") == "$(tools/source_hash.sh)" ]]; then
        PREBUILT_OK=1
    else
        echo "gpu_check: $PREBUILT was built from other sources (tools/source_hash.sh differs): building here"
    fi
fi
if (( PREBUILT_OK )); then
    # The bundle: the installed package (less pydflash/models, copied from this tree) and gpu_bin/ (test_ops,
    # gemm_chain_bench); Python's tarfile unpacks it where the image has no xz.
    run_stage build "$LOGS/build.log" bash -c "rm -rf '$WORK/prebuilt' && mkdir -p '$WORK/prebuilt' '$BUILD' && \
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter=\"tar\")' \
            '$PREBUILT/bundle.tar.xz' '$WORK/prebuilt' && \
        mv '$WORK/prebuilt/gpu_bin/test_ops' '$WORK/prebuilt/gpu_bin/gemm_chain_bench' '$BUILD/' && \
        if [[ -f '$WORK/prebuilt/gpu_bin/gemm_chain_bench_probe' ]]; then mkdir -p build/probe && \
            mv '$WORK/prebuilt/gpu_bin/gemm_chain_bench_probe' build/probe/gemm_chain_bench; fi && \
        rmdir '$WORK/prebuilt/gpu_bin' && cp -a '$WORK/prebuilt/.' '$SITE/' && cp -a pydflash/models '$SITE/pydflash/'"
    STAGE_NOTE="$STAGE_NOTE prebuilt=1"
elif (( ONLY_OPS )); then
    run_stage build "$LOGS/build.log" bash -c "cmake -S . -B '$BUILD' -DDFLASH_CUDA=ON \
        -DDFLASH_OP_TESTS=ON -DDFLASH_CUDA_ARCHITECTURES=90-real -DCMAKE_BUILD_TYPE=Release && \
        cmake --build '$BUILD' --target test_ops -j $(nproc)"
else
    run_stage build "$LOGS/build.log" python3 -m pip install --no-build-isolation --no-deps --upgrade \
        --target "$SITE" -C build-dir="$BUILD" -C cmake.define.DFLASH_CUDA=ON \
        -C cmake.define.DFLASH_OP_TESTS=ON -C cmake.define.DFLASH_CUDA_ARCHITECTURES=90-real .
fi
record build "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" build.log $STAGE_NOTE
BUILD_OK=0
if [[ $STAGE_STATUS == ok && -x $TEST_OPS ]]; then BUILD_OK=1; else fail_stage; fi

# The other side of an A/B (--ab): the library of tools/ab_source.sh's revision, built the way pip builds
# this tree's (Release, sm_90), next to it; bench.py --variants then loads it through DFLASH_LIBRARY.
if (( AB )); then
    AB_SRC=$WORK/ab_src AB_BUILD=$WORK/ab_build
    if [[ -f build/ab/libdflash.so.xz ]]; then  # ab_source.sh --prebuilt; Python's lzma, where the image has no xz
        run_stage ab_build "$LOGS/ab_build.log" bash -c "rm -rf '$AB_BUILD' && mkdir -p '$AB_BUILD' && \
            python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], \"wb\"))' \
                build/ab/libdflash.so.xz '$AB_BUILD/libdflash.so'"
        STAGE_NOTE="prebuilt=1"
    elif [[ -f build/ab/src.tar.gz ]]; then
        run_stage ab_build "$LOGS/ab_build.log" bash -c "rm -rf '$AB_SRC' && mkdir -p '$AB_SRC' && \
            tar xzf build/ab/src.tar.gz -C '$AB_SRC' && cmake -S '$AB_SRC' -B '$AB_BUILD' -DDFLASH_CUDA=ON \
            -DDFLASH_CUDA_ARCHITECTURES=90-real -DCMAKE_BUILD_TYPE=Release && \
            cmake --build '$AB_BUILD' --target dflash -j $(nproc)"
    else
        echo "=== ab_build: build/ab/src.tar.gz is missing (tools/ab_source.sh REV, carry build/ab)"
        STAGE_STATUS=failed STAGE_RC=2 STAGE_SECS=0 STAGE_NOTE=reason=no-source
    fi
    export AB_LIBRARY=$AB_BUILD/libdflash.so AB_REV="$(cat build/ab/rev 2>/dev/null)"
    record ab_build "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" ab_build.log "rev=$AB_REV" $STAGE_NOTE
    if [[ $STAGE_STATUS == ok && -f $AB_LIBRARY ]]; then echo "gpu_check: AB_LIBRARY=$AB_LIBRARY ($AB_REV)"; else fail_stage; fi
fi

# ------------------------------------------------------------------------------------------------
# 3. Device memory before
# ------------------------------------------------------------------------------------------------
MEM_BEFORE=$(gpu_memory)
echo "gpu_check: device memory used,total (MiB) before: ${MEM_BEFORE:-unavailable}"

# ------------------------------------------------------------------------------------------------
# 4. test_ops: every cuda op against the host backend
# ------------------------------------------------------------------------------------------------
ops_counts() {  # cases= failed= all_ok= from a test_ops log
    python3 - "$1" <<'EOF'
import os, re, sys
text = open(sys.argv[1], errors="replace").read() if os.path.exists(sys.argv[1]) else ""
ok = re.search(r"^ALL OK \((\d+) cases", text, re.M)
bad = re.search(r"^FAILED: (\d+) of (\d+) case", text, re.M)
if ok:
    print(f"cases={ok.group(1)} failed=0 all_ok=1")
elif bad:
    print(f"cases={bad.group(2)} failed={bad.group(1)} all_ok=0")
else:
    print("all_ok=0")
EOF
}
if (( BUILD_OK && OPS )); then
    # shellcheck disable=SC2086
    run_stage test_ops "$LOGS/test_ops.log" "$TEST_OPS" --seed "$SEED" $OPS_ARGS
    if [[ -n $DEVICE_NAME && $STAGE_STATUS == skipped && $STAGE_RC == 77 ]]; then
        echo "gpu_check: test_ops found no CUDA device although nvidia-smi sees one: counted as a failure"
        STAGE_STATUS=failed
    fi
    # shellcheck disable=SC2046
    record test_ops "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" test_ops.log $STAGE_NOTE \
        $(ops_counts "$LOGS/test_ops.log")
    [[ $STAGE_STATUS == ok || $STAGE_STATUS == skipped ]] || fail_stage
    # The persistent GEMM is off by default (DFLASH_GEMM_PERSIST=0 since session 37): its launches are tested
    # by test_ops' quick GEMM cases again with it on for every call (not after a filtered run).
    if [[ $OPS_ARGS != *--filter* ]]; then
        run_stage test_ops_persist "$LOGS/test_ops_persist.log" env DFLASH_GEMM_PERSIST=3 "$TEST_OPS" \
            --seed "$SEED" --quick --filter gemm
        # shellcheck disable=SC2046
        record test_ops_persist "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" test_ops_persist.log $STAGE_NOTE \
            $(ops_counts "$LOGS/test_ops_persist.log")
        [[ $STAGE_STATUS == ok || $STAGE_STATUS == skipped ]] || fail_stage
    fi
    # x in the ring (XLoad::Ring16) where the default does not take it (persistent and folded-norm launches):
    # DFLASH_GEMM_X_RING=15, with persistence on, after an unfiltered test_ops run or one filtered to the GEMMs.
    if [[ $OPS_ARGS != *--filter* || $OPS_ARGS == *gemm* ]]; then
        run_stage test_ops_xring "$LOGS/test_ops_xring.log" env DFLASH_GEMM_PERSIST=3 DFLASH_GEMM_X_RING=15 \
            "$TEST_OPS" --seed "$SEED" --quick --filter gemm
        # shellcheck disable=SC2046
        record test_ops_xring "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" test_ops_xring.log $STAGE_NOTE \
            $(ops_counts "$LOGS/test_ops_xring.log")
        [[ $STAGE_STATUS == ok || $STAGE_STATUS == skipped ]] || fail_stage
        # x by the copy engine wherever Ring16 would run, not persistent: a 128-byte copy a row (XLoad::RingBulk,
        # =31), and one tensor copy a chunk (RingTma, the default's where Ring16 ran) in the folded-norm launches too
        for bulk in "bulk 31" "tma 95"; do
            read -r name mask <<< "$bulk"
            run_stage "test_ops_$name" "$LOGS/test_ops_$name.log" env DFLASH_GEMM_X_RING="$mask" \
                "$TEST_OPS" --seed "$SEED" --quick --filter gemm,logits
            # shellcheck disable=SC2046
            record "test_ops_$name" "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" "test_ops_$name.log" $STAGE_NOTE \
                $(ops_counts "$LOGS/test_ops_$name.log")
            [[ $STAGE_STATUS == ok || $STAGE_STATUS == skipped ]] || fail_stage
        done
    fi
    # The key-quarter attention kernel with chunks of 128 keys (DFLASH_ATTN_CHUNK=128, off by default), after an
    # unfiltered test_ops run or one filtered to attention.
    if [[ $OPS_ARGS != *--filter* || $OPS_ARGS == *attention* ]]; then
        run_stage test_ops_chunk128 "$LOGS/test_ops_chunk128.log" env DFLASH_ATTN_CHUNK=128 \
            "$TEST_OPS" --seed "$SEED" --quick --filter attention
        # shellcheck disable=SC2046
        record test_ops_chunk128 "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" test_ops_chunk128.log $STAGE_NOTE \
            $(ops_counts "$LOGS/test_ops_chunk128.log")
        [[ $STAGE_STATUS == ok || $STAGE_STATUS == skipped ]] || fail_stage
    fi
elif (( OPS )); then
    record test_ops skipped -1 0 - reason=build-failed
fi

# ------------------------------------------------------------------------------------------------
# 5. pytest -m gpu (the installed package, not the source tree: python3 -P keeps the cwd off sys.path)
# ------------------------------------------------------------------------------------------------
junit_counts() {  # passed= failed= skipped= errors= from a junit xml
    python3 - "$1" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception:
    print("passed=0 failed=0 skipped=0 errors=0"); sys.exit()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
t = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(f"passed={t['tests'] - t['failures'] - t['errors'] - t['skipped']} failed={t['failures']} "
      f"skipped={t['skipped']} errors={t['errors']}")
EOF
}
export DFLASH_TEST_OPS=$TEST_OPS
export PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH}
if (( PYTEST && BUILD_OK )); then
    # tests/test_cuda_ops.py only re-runs test_ops, which stage 4 ran already.
    run_stage pytest "$LOGS/pytest.log" python3 -P -m pytest -m gpu -q -rs \
        -p no:cacheprovider --ignore=tests/test_cuda_ops.py --junitxml="$LOGS/pytest.xml" \
        "${PYTEST_WORDS[@]}" tests
    (( STAGE_RC == 5 )) && STAGE_STATUS=ok  # no GPU test collected is not a failure
    counts=$(junit_counts "$LOGS/pytest.xml")
    if [[ -n $DEVICE_NAME && $STAGE_STATUS == ok && $counts == passed=0\ * && $counts != *skipped=0* ]]; then
        echo "gpu_check: every GPU test was skipped although nvidia-smi sees a GPU: counted as a failure"
        STAGE_STATUS=failed STAGE_NOTE=reason=all-skipped-on-a-gpu-machine
    fi
    # shellcheck disable=SC2086
    record pytest "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" pytest.log $STAGE_NOTE $counts
    [[ $STAGE_STATUS == ok ]] || fail_stage
elif (( PYTEST )); then
    record pytest skipped -1 0 - reason=build-failed
fi

# ------------------------------------------------------------------------------------------------
# 5b. The speed benchmark (tools/bench.py) and an extra command, before the slow sanitizer runs
# ------------------------------------------------------------------------------------------------
if (( BENCH && BUILD_OK )); then
    # shellcheck disable=SC2086
    plot=("--plot" "$OUT_DIR/bench.png")
    (( LEAN )) && plot=("--plot" "$LOGS/bench.png")
    run_stage bench "$LOGS/bench.log" python3 -P tools/bench.py --json "$OUT_DIR/bench.json" \
        "${plot[@]}" $BENCH_ARGS
    (( LEAN )) || cp "$LOGS/bench.log" "$OUT_DIR/logs/bench.log" 2>/dev/null || true
    record bench "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" bench.log $STAGE_NOTE
    [[ $STAGE_STATUS == ok ]] || fail_stage
fi
if [[ -n $THEN ]] && (( BUILD_OK )); then
    run_stage then "$LOGS/then.log" env LOGS="$LOGS" OUT="$OUT_DIR" bash -c "$THEN"
    record then "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" then.log $STAGE_NOTE
    [[ $STAGE_STATUS == ok ]] || fail_stage
fi

# ------------------------------------------------------------------------------------------------
# 6. compute-sanitizer: each tool over test_ops, then each over the GPU pytest run
# ------------------------------------------------------------------------------------------------
sanitizer_errors() {  # sums "ERROR SUMMARY: N errors" (and racecheck's "(N errors") over all processes
    python3 - "$1" <<'EOF'
import os, re, sys
text = open(sys.argv[1], errors="replace").read() if os.path.exists(sys.argv[1]) else ""
found = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
if not found:
    found = [int(n) for n in re.findall(r"RACECHECK SUMMARY: .*?\((\d+) error", text)]
print(f"errors={sum(found)}" if found else "errors=unknown")
EOF
}
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# sanitize_job NAME LOG CMD...: one sanitizer run, meant for the background: its console output goes
# to LOG.console, its record to stages.jsonl (the summary is rewritten once all jobs are done).
sanitize_job() {
    local name=$1 log=$2
    shift 2
    IN_PARALLEL=1 run_stage "$name" "$LOGS/$log" "$@" > "$LOGS/$log.console" 2>&1
    (( STAGE_RC == 5 )) && [[ $name == *:pytest ]] && STAGE_STATUS=ok  # nothing collected
    local errors
    errors=$(sanitizer_errors "$LOGS/$log")
    # shellcheck disable=SC2086
    IN_PARALLEL=1 record "$name" "$STAGE_STATUS" "$STAGE_RC" "$STAGE_SECS" "$log" $STAGE_NOTE $errors
    echo "=== $name: $STAGE_STATUS (rc $STAGE_RC, $STAGE_SECS s, $errors)"
}
if (( SANITIZE )) && (( BUILD_OK )); then
    if [[ ! -x $SANITIZER ]]; then
        echo "gpu_check: compute-sanitizer not found; sanitizer stages not run"
        record sanitizers failed -1 0 - reason=compute-sanitizer-not-found
        fail_stage
    else
        # Every tool over test_ops and over the GPU pytest suite, all at once: each run is mostly
        # host-side instrumentation, so side by side they take about as long as the slowest one.
        # The pytest runs see DFLASH_TEST_SHARED_GPU=1 (device-wide memory readings are not compared
        # while other processes allocate; memcheck's leak check covers leaks) and a shorter lifecycle
        # test (SAN_CYCLES, default 30), one prompt per lossless case (SAN_TRIALS) and 10 steps per
        # graph-test run (SAN_GRAPH_STEPS); the plain pytest stage above ran them in full.
        IFS=, read -r -a tools <<< "$SANITIZERS"
        ops_level=()
        [[ $OPS_SAN_LEVEL == default ]] || ops_level=(--"$OPS_SAN_LEVEL")
        subset=()
        (( QUICK )) && subset=(-k smoke)
        # pytest-xdist, where the image has it: each tool's tests spread over SAN_WORKERS processes.
        workers=()
        if python3 -c 'import xdist' 2>/dev/null && (( ${SAN_WORKERS:-3} > 1 )); then
            workers=(-n "${SAN_WORKERS:-3}")
        fi
        echo "=== sanitizers [t=$(elapsed) s]: ${tools[*]}, over test_ops (ops=$OPS) and pytest (pytest=$((PYTEST && SAN_PYTEST))), in parallel"
        pids=()
        for tool in "${tools[@]}"; do
            extra=()
            [[ $tool == memcheck ]] && extra=(--leak-check full)
            # --report-api-errors no: the out-of-memory test makes cudaMalloc fail on purpose, and the
            # library turns every CUDA API error into a status that the tests check anyway.
            san=("$SANITIZER" --tool "$tool" --error-exitcode 1 --print-limit 20 --report-api-errors no
                 "${extra[@]}")
            if (( OPS )); then
                sanitize_job "sanitizer:$tool:test_ops" "san_${tool}_test_ops.log" \
                    "${san[@]}" "$TEST_OPS" --seed "$SEED" "${ops_level[@]}" &
                pids+=($!)
            fi
            if (( PYTEST && SAN_PYTEST )); then
                # racecheck checks shared memory within a kernel, which eager launches cover as well
                # as graph replays, so by default it runs eagerly and skips the graph-replay test, the
                # slowest one under it (SAN_RACECHECK_GRAPHS=1 keeps graphs). It also needs the most
                # host memory: workers that died without a report were taken by the host's OOM killer
                # at 30-54 GB each, with four tools side by side (session 10's log; session 9's deaths
                # looked the same but predate the log). So it gets its own worker count
                # (SAN_RACECHECK_WORKERS, default 3), 12 generated tokens per lossless prompt
                # (SAN_RACECHECK_TOKENS) and a -k a later run can narrow (SAN_RACECHECK_K).
                graphs=${DFLASH_CUDA_GRAPHS:-1} only=() tool_workers=("${workers[@]}")
                tokens=${SAN_TOKENS:-48}
                if [[ $tool == racecheck ]] && (( ! QUICK )); then
                    if [[ ${SAN_RACECHECK_GRAPHS:-0} == 0 ]]; then
                        graphs=0 only=(-k "${SAN_RACECHECK_K:-not graph_replays}")
                    elif [[ -n ${SAN_RACECHECK_K:-} ]]; then
                        only=(-k "$SAN_RACECHECK_K")
                    fi
                    tokens=${SAN_RACECHECK_TOKENS:-12}
                    (( ${#workers[@]} )) && tool_workers=(-n "${SAN_RACECHECK_WORKERS:-3}")
                fi
                # test_cuda_ops.py only re-runs test_ops, which is sanitized directly.
                # shellcheck disable=SC2086
                DFLASH_CUDA_GRAPHS=$graphs \
                DFLASH_TEST_SHARED_GPU=1 DFLASH_TEST_LIFECYCLE_CYCLES=${SAN_CYCLES:-30} \
                    DFLASH_TEST_LOSSLESS_TRIALS=${SAN_TRIALS:-1} DFLASH_TEST_LOSSLESS_TOKENS=$tokens \
                    DFLASH_TEST_GRAPH_STEPS=${SAN_GRAPH_STEPS:-10} \
                    sanitize_job "sanitizer:$tool:pytest" "san_${tool}_pytest.log" \
                    "${san[@]}" --target-processes all python3 -P -m pytest -m gpu -v -x --durations=0 \
                    -p no:cacheprovider --ignore=tests/test_cuda_ops.py "${tool_workers[@]}" "${subset[@]}" "${only[@]}" \
                    "${PYTEST_WORDS[@]}" tests &
                pids+=($!)
            fi
        done
        (( ${#pids[@]} )) && wait "${pids[@]}"
        # A worker that dies under a sanitizer ("node down") leaves no report of its own: record
        # the host's memory and any kernel OOM kill next to the sanitizer logs.
        { free -m; dmesg 2>/dev/null | grep -i -E "killed process|out of memory" | tail -5; } \
            > "$LOGS/host_memory_after_sanitizers.log" 2>&1 || true
        python3 - "$WORK/stages.jsonl" <<'EOF' || fail_stage
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
bad = [r["name"] for r in rows if r["name"].startswith("sanitizer:") and r["status"] not in ("ok", "skipped")]
sys.exit(1 if bad else 0)
EOF
        summarize "$ALL_ARGS"
    fi
fi

# ------------------------------------------------------------------------------------------------
# 7. Device memory after, summary
# ------------------------------------------------------------------------------------------------
MEM_AFTER=$(gpu_memory)
echo "gpu_check: device memory used,total (MiB) after: ${MEM_AFTER:-unavailable}"
echo "gpu_check: $( (( OVERALL_OK )) && echo PASS || echo FAIL ) in $(elapsed) s; summary in $OUT_DIR/summary.md"
summarize "$ALL_ARGS"
trap - EXIT
cat "$OUT_DIR/summary.md"
(( OVERALL_OK )) && exit 0 || exit 1
