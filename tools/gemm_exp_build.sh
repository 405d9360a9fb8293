#!/usr/bin/env bash
# gemm_exp_build.sh: gemm_chain_bench binaries whose small-M GEMM TUs (gemv.cu and gemv_<family>.cu, with
# gemv_kernels.cuh) are compiled with DFLASH_GEMM_EXP bits (gemv_kernels.cuh: timing experiments that strip
# features from the ring-fed GEMM; the results are then wrong), or taken from another revision (its gemv*.cu
# and gemv*.cuh: before the split, its one gemv.cu), packed for the device (carry build/exp_carry; run them
# with tools/gemm_exp_run.sh).
#   tools/gemm_exp_build.sh 0 8 16              # this tree's gemv TUs at DFLASH_GEMM_EXP=0, 8, 16
#   tools/gemm_exp_build.sh main:0 0 8          # main's gemv TUs at 0, then this tree's at 0 and 8
# Bits: 1 no row_scales (folded-norm factors 1), 2 no kStats, 4 no stores, 8 no x loads, 16 no finish at all,
# 32 no griddepcontrol.wait, 64 x-in-the-ring launches (Ring8/Ring16: 2-16 rows) take the plain ring of weights
# instead (7 chunks a warp against Ring16's 3; 72 = 64 + 8: that ring and no x loads, against 8: the depth's cost),
# 128 / 256 with 64: that ring capped at 5 / 4 chunks (200 = 128 + 64 + 8, 328 = 256 + 64 + 8: session 44).
# Needs a configured build/local (cmake -DDFLASH_OP_TESTS=ON ...; ninja -C build/local gemm_chain_bench): the
# other objects are linked from there. About 130 s of compiling per variant (the TUs
# of a variant in parallel), two variants at a time.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
export PATH=/usr/local/cuda/bin:$PATH
B=build/local
[[ -f $B/build.ninja ]] || { echo "gemm_exp_build: configure build/local first (this header: cmake -DDFLASH_OP_TESTS=ON ... -B build/local)" >&2; exit 2; }
ninja -C "$B" gemm_chain_bench > /dev/null
rm -rf build/exp build/exp_tus && mkdir -p build/exp build/exp_carry build/exp_tus
build_one() {  # SPEC: [REV:]BITS
    local spec=$1 rev="" bits=$1 tag dir srcs
    if [[ $spec == *:* ]]; then rev=${spec%%:*}; bits=${spec#*:}; fi
    tag=${rev:-tree}_$bits
    dir=build/exp_tus/$tag  # the variant's sources (REV) and objects
    mkdir -p "$dir"
    if [[ -n $rev ]]; then  # the revision's gemv*.cu and gemv*.cuh next to each other (its #includes find them)
        local f
        for f in $(git ls-tree --name-only "$rev" native/src/cuda/ | grep -E '^native/src/cuda/gemv[^/]*\.cuh?$'); do
            git show "$rev:$f" > "$dir/$(basename "$f")"
        done
        srcs=$(ls "$dir"/gemv*.cu)
    else
        srcs=$(ls native/src/cuda/gemv*.cu)
    fi
    printf '%s\n' $srcs | xargs -P "$JOBS" -I{} sh -c 'nvcc -DDFLASH_GEMM_EXP="$1" -DDFLASH_BUILDING_LIBRARY \
        -DDFLASH_CUDA_ARCH_LIST=\"90-real\" -Inative/include -Inative/src -Inative/src/cuda -O3 -DNDEBUG -std=c++17 \
        "--generate-code=arch=compute_90,code=[sm_90]" -Xcompiler=-fPIC -x cu -c "$2" -o "$3/$(basename "$2").o"' \
        _ "$bits" {} "$dir" || return 1
    local objs
    # every gemv TU's object (gemv.cu.o, gemv_<family>.cu.o) is replaced by the variant's
    objs=$(ls $B/CMakeFiles/dflash_objects.dir/native/src/*.o $B/CMakeFiles/dflash_objects.dir/native/src/host/*.o \
           $B/CMakeFiles/dflash_objects.dir/native/src/cuda/*.o | grep -Ev '/gemv[^/]*\.cu\.o$')
    g++ $objs "$dir"/gemv*.cu.o $B/CMakeFiles/gemm_chain_bench.dir/tools/gemm_chain_bench.cpp.o \
        -o "build/exp/gemm_chain_bench_$tag" -lcudadevrt -lcudart_static -lrt -lpthread -ldl \
        -L/usr/local/cuda/targets/x86_64-linux/lib/stubs -L/usr/local/cuda/targets/x86_64-linux/lib
    echo "gemm_exp_build: build/exp/gemm_chain_bench_$tag"
}
export -f build_one
export B JOBS=$(( ($(nproc) + 1) / 2 ))  # nvcc jobs per variant
printf '%s\n' "$@" | xargs -P2 -I{} bash -c 'build_one {}'
tar czf build/exp_carry/bins.tar.gz -C build/exp .
ls -la build/exp_carry/bins.tar.gz
