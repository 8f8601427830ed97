#!/bin/bash
# Nsight Compute's view of Hopper forward configurations at B 8, T 4096, causal: the engine's
# one-warpgroup forward and the warp-specialised ones at head size 128 by default, or the
# configurations named as arguments (the harness's names, e.g. ws_bf16_hs128_n128_s2q). Each
# runs alone (`harness profile NAME`: five warm-up launches, the sixth profiled) with issue,
# stall, occupancy and memory sections, then once more for its warp-stall reasons (warps
# stalled for each reason per issued instruction) and pipe utilisations, which
# `ncu_stalls.py` lists largest first. Run from the repository root on a Hopper GPU:
#   bash bench/wgmma_attention/ncu.sh [NAME ...]
set -o pipefail
dir=$(dirname "$0")
out=${OUT:-/tmp}
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(wg_bf16_hs128_n64 ws_bf16_hs128_n64_s4 ws_bf16_hs128_n128_s2q)
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_harness "$dir/harness.cu" || exit 1
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
