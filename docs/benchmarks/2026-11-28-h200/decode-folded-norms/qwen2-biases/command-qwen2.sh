#!/usr/bin/env bash
# A random Qwen2.5-0.5B configuration (query/key/value biases; norm gains drawn from [0.5, 1.5])
# against transformers: fp32 greedy, 3 prompts x 64 tokens (bench/llama_parity.py).
set -u
gunzip -c gpubin/kiln-bias.gz > /tmp/kiln-bias; chmod +x /tmp/kiln-bias
s=$(date +%s)
PYTHONUNBUFFERED=1 timeout 280 python3 bench/llama_parity.py --kiln /tmp/kiln-bias --tokenizer gpubin/tok --work /tmp/pq --only qwen2.5-0.5b 2>&1 | grep -E "^\||rror" | tee $OUT/parity-qwen2.txt
echo "t=$(( $(date +%s)-s ))"
