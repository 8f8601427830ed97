#!/usr/bin/env bash
# Nsight Compute's view of the engine's persistent forwards in the harness (B 8, T 4096,
# causal; `harness profile NAME`): head size 128 (two consumers, 128-key tiles) and head size
# 64 (three consumers), their issue, stall, occupancy and memory sections, warp-stall reasons
# and pipe utilisations. Run from the repository root on a Hopper GPU.
set -u
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=$R timeout 500 bash bench/wgmma_attention/ncu.sh wp_bf16_hs128_n128_s2_pp wp_bf16_hs64_n128_s2_pp_c3 2>&1 | tee $R/ncu-run.log
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
