#!/usr/bin/env bash
# `kiln plan --generate` against real calls' pool peaks with the new build; the Llama-3.2-1B
# shape beside transformers generate in one command.
set -u
gunzip -c gpubin/kiln-append.gz > /tmp/kiln-append; chmod +x /tmp/kiln-append
s=$(date +%s)
KILN=/tmp/kiln-append OUT=/tmp/pgc timeout 200 bash bench/plan_generate_gpu_check.sh 2>&1 | tee $OUT/plan-generate.log
echo "plan check t=$(( $(date +%s)-s ))"
timeout 300 /tmp/kiln-append bench generate --shape llama-3.2-1b --batches 1,8,64,256 --new-tokens 128 --out $OUT/bg-hf-l1b > $OUT/bench-hf-l1b.log 2>&1; echo "bench hf rc $? t=$(( $(date +%s)-s ))"
grep -E "^(kiln|transformers) batch" $OUT/bench-hf-l1b.log
