#!/usr/bin/env bash
# Nsight Compute on the fused backward's dK/dV kernel in its three modes (after
# command-modes.sh): copies in turn (1), in no fixed order (unordered), none (local); bf16,
# B 4, T 4096, 16 heads of 128. Build: gpubin/kiln-fqmodes.xz.
set -u
xz -dc gpubin/kiln-fqmodes.xz > /tmp/kiln-modes && chmod +x /tmp/kiln-modes
for m in 1 unordered local; do
  mkdir -p $OUT/$m
  KILN_ATTENTION_FUSED_DQ=$m OUT=$OUT/$m SHAPE="--dtypes bf16 --seq 4096 --rows 16384 --channels 2048 --heads 16" \
    timeout 170 bash bench/wgmma_attention/ncu_engine.sh /tmp/kiln-modes attention_backward_dkvq_bf16_hs128
done
