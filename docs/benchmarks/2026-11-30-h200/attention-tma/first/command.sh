#!/usr/bin/env bash
# The TMA-fed attention forward against the engine's cp.async one (bench/wgmma_attention/tma_ab.sh).
set -u
R=$OUT
s=$(date +%s)
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
OUT=$R/tma-ab bash bench/wgmma_attention/tma_ab.sh /tmp/kiln
echo "done t=$(( $(date +%s)-s ))"
