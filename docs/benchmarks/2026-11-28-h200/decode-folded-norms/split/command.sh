#!/usr/bin/env bash
# Where a SmolLM2-135M batch-64 decode step's time goes, with this build (05ff830): `kiln bench
# generate --no-python` (random weights, 64-token prompts, bf16) sampled (temperature 0.9,
# top-p 0.9) and greedy alternating, then 512 new tokens (a longer cache), then every kernel
# launched (no CUDA graphs).
set -u
gunzip -c gpubin/kiln-ce.gz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
run() { timeout 150 /tmp/kiln bench generate --shape smollm2-135m --batches 64 --no-python --out /tmp/bg-$1 "${@:2}" > $OUT/$1.log 2>&1; echo "$1 rc $? t=$(( $(date +%s)-s ))"; grep -E "^\| kiln" /tmp/bg-$1/report.md; }
run sampled1 --new-tokens 128
run greedy1 --new-tokens 128 --temperature 0
run sampled2 --new-tokens 128
run greedy2 --new-tokens 128 --temperature 0
run long512 --new-tokens 512
run nographs --new-tokens 128 --no-cuda-graphs
