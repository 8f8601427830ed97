#!/usr/bin/env bash
# Folded norm gains, correctness on the GPU: greedy parity with transformers in fp32 (random
# SmolLM2-135M and Llama-3.2-1B configurations with norm gains drawn from [0.5, 1.5]), then
# bench/decode_gpu_check.sh (CUDA graphs, slot reuse and queued steps change no token).
set -u
gunzip -c gpubin/kiln-fold.gz > /tmp/kiln-fold; chmod +x /tmp/kiln-fold
s=$(date +%s)
PYTHONUNBUFFERED=1 timeout 330 python3 bench/llama_parity.py --kiln /tmp/kiln-fold --tokenizer gpubin/tok --work /tmp/parity --only smollm2-135m,llama-3.2-1b 2>&1 | grep -v Warning | tail -12
echo "parity t=$(( $(date +%s)-s ))"
SELFTEST=0 KILN=/tmp/kiln-fold OUT=/tmp/dc timeout 230 bash bench/decode_gpu_check.sh 2>&1 | tail -25
echo "t=$(( $(date +%s)-s ))"
