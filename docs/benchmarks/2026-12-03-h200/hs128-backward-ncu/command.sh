#!/usr/bin/env bash
# Nsight Compute's view of the engine's head-size-128 attention backward (bf16, B 4, T 4096,
# 16 heads; `kiln bench kernels` launching them): the dK/dV kernel, then the dQ kernel, each
# with issue, stall, occupancy and memory sections, L2 and DRAM bytes, then warp-stall reasons
# and pipe utilisations (bench/wgmma_attention/ncu_engine.sh). Results go straight to $OUT.
# Run from the repository root with gpubin/kiln-fold.xz (the build of 6486005).
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-fold.xz > /tmp/kiln && chmod +x /tmp/kiln
OUT=$OUT SHAPE="--dtypes bf16 --seq 4096 --rows 16384 --channels 2048 --heads 16" \
  bash bench/wgmma_attention/ncu_engine.sh /tmp/kiln attention_backward_dkv_bf16_hs128 attention_backward_dq_bf16_hs128 2>&1 | tee $OUT/ncu-run.log
