#!/usr/bin/env bash
# The training group of `kiln selftest` with the Llama-family parity rows (a tiny Llama with
# grouped-query heads of 64, and the same with Qwen3's query/key norms and QKV biases; CPU fp32
# against the GPU in fp32 and bf16-mixed, 50 steps).
set -u
R=$OUT
xz -dc gpubin/kiln-tp.xz > /tmp/kiln-tp && chmod +x /tmp/kiln-tp
s=$(date +%s)
timeout 400 /tmp/kiln-tp selftest --only training > $R/selftest-training.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "parity|offload|recomputation|scaler|checks" $R/selftest-training.log | cut -c1-260
