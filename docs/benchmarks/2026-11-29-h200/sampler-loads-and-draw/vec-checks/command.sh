#!/usr/bin/env bash
# vec (runs of 8 ids a thread in one 16-byte load): the kernel selftest, SmolLM2-135M fp32 greedy
# parity with transformers, and every kernel of one SmolLM2-135M batch-64 decode step under
# Nsight Compute.
set -u
R=$OUT
xz -dc gpubin/kiln-vec.xz > /tmp/kiln-vec && chmod +x /tmp/kiln-vec
s=$(date +%s)
timeout 290 /tmp/kiln-vec selftest --only kernels > $R/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks," $R/selftest.log | tail -2; grep -E "FAIL" $R/selftest.log | head -20
timeout 100 python3 bench/llama_parity.py --kiln /tmp/kiln-vec --tokenizer gpubin/tok --work /tmp/pl --only smollm2-135m > $R/parity.log 2>&1; echo "parity rc $? t=$(( $(date +%s)-s ))"; grep -E "^\|" $R/parity.log | tail -2; grep -E "rror|Trace" $R/parity.log | head -5
timeout 120 /usr/local/cuda/bin/ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 900 --launch-count 480 /tmp/kiln-vec bench generate --shape smollm2-135m --batches 64 --new-tokens 24 --no-python --no-cuda-graphs --out /tmp/bgd > /tmp/ncu_step.csv 2>/dev/null; echo "ncu rc $? t=$(( $(date +%s)-s ))"
python3 docs/benchmarks/2026-11-29-h200/few-rows-products/ncu/decode_steps.py /tmp/ncu_step.csv > $R/decode_step.txt; head -16 $R/decode_step.txt
gzip -c /tmp/ncu_step.csv > $R/ncu_step.csv.gz
