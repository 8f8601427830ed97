#!/bin/bash
# The GPU sampler against an earlier version of itself, on the GPU machine, from the repository
# root: bit-for-bit comparison of every output (tokens, log-probabilities, positions, counters,
# presence masks, each row's state) over 9 logit distributions, 11 settings, 6 shapes and three
# dtypes, then per-stage timings.
#   bash bench/sampler_ab/run.sh MODE [VARIANT...]
# MODE: check, time, check+time, ncu; VARIANT: name:-DX=1,-DY=2 (compiled from the current
# sampling.cu with NVRTC). The old kernel is src/engine/cuda/sampling.cu at $OLD (default
# 1b10248), or bench/sampler_ab/orig.cu if given there (the GPU machine's copy has no git).
set -u
cd "$(dirname "$0")"
[ -f orig.cu ] || git show "${OLD:-1b10248}:src/engine/cuda/sampling.cu" > orig.cu || exit 1
cp ../../src/engine/cuda/common.cuh .
cp ../../src/engine/cuda/sampling.cu new.cu
nvcc -O3 -std=c++17 -w harness.cu -o harness -lnvrtc -lcuda || exit 1
mode=$1; shift
case $mode in
  check+time) ./harness check "$@" && ./harness time "$@" ;;
  ncu) DIST=${DIST:-flat03} ncu --kernel-name regex:'sample_' --launch-skip $((8 * ($#>0 ? $#+1 : 2))) --metrics gpu__time_duration.sum,smsp__inst_executed.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active ./harness ncu "$@" 2>&1 | grep -E '^  [a-z_]+|duration|inst_exec|registers|warps_active' ;;
  *) ./harness $mode "$@" ;;
esac
