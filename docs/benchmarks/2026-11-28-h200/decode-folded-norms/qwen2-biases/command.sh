#!/usr/bin/env bash
# Folded norm gains with Qwen2's query/key/value biases added by the append: the kernel
# selftest, then bench/llama_parity.py --windowed (a Mistral with a 64-position window; a Qwen2
# with biases, a 48-position window from layer 2; norm gains drawn from [0.5, 1.5]; fp32 greedy
# against transformers) and the plain SmolLM2-135M configuration again.
set -u
gunzip -c gpubin/kiln-bias.gz > /tmp/kiln-bias; chmod +x /tmp/kiln-bias
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 240 /tmp/kiln-bias selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|FAIL" $OUT/selftest.log | head -20; grep -E "kv_append_normed.*bias" $OUT/selftest.log | head -30
PYTHONUNBUFFERED=1 timeout 200 python3 bench/llama_parity.py --kiln /tmp/kiln-bias --tokenizer gpubin/tok --work /tmp/pw --windowed 2>&1 | grep -E "^\|" | tee $OUT/parity-windowed.txt
PYTHONUNBUFFERED=1 timeout 120 python3 bench/llama_parity.py --kiln /tmp/kiln-bias --tokenizer gpubin/tok --work /tmp/ps --only smollm2-135m 2>&1 | grep -E "^\|" | tee $OUT/parity-smollm2.txt
echo "t=$(( $(date +%s)-s ))"
