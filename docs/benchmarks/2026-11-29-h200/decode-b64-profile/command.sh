#!/usr/bin/env bash
# Where a SmolLM2-135M batch-64 decode step's kernels stall (71a3b32, graphs off so Nsight
# Compute sees each launch): warp states, occupancy and throughput of one launch of each kernel.
set -u
xz -dc gpubin/kiln-att.xz > /tmp/kiln; chmod +x /tmp/kiln
s=$(date +%s)
timeout 150 /tmp/kiln bench generate --shape smollm2-135m --batches 1 --new-tokens 8 --no-python --out /tmp/warm > /tmp/warm.log 2>&1; echo "warm rc $? t=$(( $(date +%s)-s ))"
K='regex:few_rows_product_bf16_x2|few_rows_swiglu_bf16_grouped|cache_attention_append_bf16_l8_g3|sample_max_bf16|sample_histogram_bf16|sample_select_bf16|sample_draw_bf16'
timeout 200 /usr/local/cuda/bin/ncu --cache-control none --clock-control none -k "$K" --launch-skip 400 --launch-count 9 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats /tmp/kiln bench generate --shape smollm2-135m --batches 64 --new-tokens 16 --no-python --no-cuda-graphs --out /tmp/bgd > $OUT/ncu.txt 2>&1; echo "ncu rc $? t=$(( $(date +%s)-s ))"
grep -E "^  [a-z_]+.*\(|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|Issued Warp Per|No Eligible|Memory Throughput|Compute \(SM\) Throughput|Waves Per SM|Shared Memory Configuration Size|Dynamic Shared|Static Shared" $OUT/ncu.txt | head -150
