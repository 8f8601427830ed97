#!/usr/bin/env bash
# fp32 greedy against transformers with the three-head build (SmolLM2-135M shape: 9 heads over
# 3, so decode steps take the new wide blocks), prompts long enough for the packed prefill.
set -u
gunzip -c gpubin/kiln-g3.gz > /tmp/kiln-g3; chmod +x /tmp/kiln-g3
PYTHONUNBUFFERED=1 timeout 150 python3 bench/llama_parity.py --kiln /tmp/kiln-g3 --tokenizer gpubin/tok --work /tmp/pl --only smollm2-135m --long-prompts 2>&1 | grep -E "^\||rror|Trace" | tee $OUT/parity-smollm2-135m-long.txt
PYTHONUNBUFFERED=1 timeout 150 python3 bench/llama_parity.py --kiln /tmp/kiln-g3 --tokenizer gpubin/tok --work /tmp/pl2 --only smollm2-135m 2>&1 | grep -E "^\||rror|Trace" | tee $OUT/parity-smollm2-135m.txt
