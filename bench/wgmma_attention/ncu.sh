#!/bin/bash
# Nsight Compute's view of Hopper forward configurations at B 8, T 4096, causal: the engine's
# one-warpgroup forward (with the threads' copies and with TMA) and the persistent one at head
# size 128 by default, or the configurations named as arguments (the harness's names, e.g.
# wp_bf16_hs128_n64_s4_pp; built with the TMA configurations, as `TMA=1 run.sh` builds). Each
# runs alone (`harness profile NAME`: five warm-up launches, the sixth profiled) with issue,
# stall, occupancy and memory sections, then once more for its warp-stall reasons (warps
# stalled for each reason per issued instruction) and pipe utilisations, which
# `ncu_stalls.py` lists largest first. Run from the repository root on a Hopper GPU:
#   bash bench/wgmma_attention/ncu.sh [NAME ...]
set -o pipefail
dir=$(dirname "$0")
out=${OUT:-/tmp}
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(wg_bf16_hs128_n64 wg_bf16_hs128_n64_tma wp_bf16_hs128_n128_s2_pp)
# The TMA configurations need the driver's cuTensorMapEncodeTiled, as in run.sh.
libcuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
cuda=$(dirname "$(dirname "$(which nvcc)")")
if [ -n "$libcuda" ]; then extra=(-DKILN_HARNESS_TMA -Xlinker "$libcuda")
else extra=(-DKILN_HARNESS_TMA -L"$cuda/lib64/stubs" -lcuda); fi
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a "${extra[@]}" -o /tmp/wgmma_harness "$dir/harness.cu" || exit 1
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for n in "${names[@]}"; do
    "$NCU" -k "regex:^$n\$" -s 5 -c 1 --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \
        /tmp/wgmma_harness profile "$n" > "$out/ncu-$n.txt" 2>&1
    echo "== $n (ncu rc $?)"
    grep -E "^profile|Duration|Issue Slots Busy|No Eligible|Stall|Warp Cycles Per Issued|L2 Cache Thr|Memory Thr|Compute \(SM\) Thr|Registers Per|Achieved Occ|Shared Memory Configuration Size" "$out/ncu-$n.txt" | head -30
    "$NCU" -k "regex:^$n\$" -s 5 -c 1 --csv \
        --metrics "gpu__time_duration.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active,regex:sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*.avg.pct_of_peak_sustained_active" \
        /tmp/wgmma_harness profile "$n" > "$out/ncu-$n.csv" 2>"$out/ncu-$n.err"
    echo "-- $n stalls and pipes (ncu rc $?)"
    python3 "$dir/ncu_stalls.py" "$out/ncu-$n.csv"
done
