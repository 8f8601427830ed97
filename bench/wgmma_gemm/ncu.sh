#!/bin/bash
# Nsight Compute's view of the harness's products (after run.sh built /tmp/wgmma_gemm): speed
# of light, memory, warp stalls, for one warm launch of each kernel named (regex), and of
# cuBLASLt's kernel beside them. Run from the repository root on a Hopper GPU:
#   bash bench/wgmma_gemm/ncu.sh 'gemm_tn_plain_s4|gemm_tn_gelu_s4'
out=${OUT:-/tmp}
for k in $(echo "$1" | tr '|' ' '); do
    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section ComputeWorkloadAnalysis --section Occupancy \
        -k "regex:^$k\$" --launch-skip 1 -c 1 /tmp/wgmma_gemm > "$out/ncu_$k.txt" 2>&1
    grep -E "Duration|Throughput|Pipe|Stall|Issue|Warp Cycles|Eligible|Occupancy|L2 Hit|Registers" "$out/ncu_$k.txt" | head -60
done
ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    -k "regex:sm90_xmma|nvjet|gemm" --launch-skip 3 -c 1 /tmp/wgmma_gemm > "$out/ncu_cublas.txt" 2>&1
grep -E "^  [a-z_0-9]+.*\(|Duration|Throughput|Warp Cycles|Eligible" "$out/ncu_cublas.txt" | head -30
