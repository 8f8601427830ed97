#!/usr/bin/env bash
# From the repository root on the GPU machine (gpubin/ as in ../longrope-and-1b-lora/): LongRoPE
# against transformers past the trained context and across it, after each sequence takes the
# factors of its own length (prefills grouped by choice, decode steps from one stepwise table).
set -u
xz -dc gpubin/kiln-new.xz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
s=$(date +%s)
(time python3 bench/phi3_parity.py --kiln /tmp/kiln --tokenizer gpubin/tok --work /tmp/phi3 --only-long) > $OUT/phi3-long.log 2>&1; echo "phi3 rc $? t=$(( $(date +%s)-s ))"
grep -v "Loading weights\|Writing model" $OUT/phi3-long.log | tail -8
# Which semantics transformers' generation follows across the trained context (diagnose.py).
python3 docs/benchmarks/2026-12-01-h200/longrope-per-sequence/diagnose.py --kiln /tmp/kiln --tokenizer gpubin/tok --work /tmp/phi3-diag > $OUT/diagnose.log 2>&1; echo "diagnose rc $?"
grep -v "Loading weights\|Writing model\|^\[transformers\]" $OUT/diagnose.log | tail -60
