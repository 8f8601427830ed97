#!/usr/bin/env bash
# g7: 6-warp gate/up blocks for every 16-row call whose grid exceeds an SM each (batches 17-64),
# against 8 warps in the same binary (KILN_GATE_UP_SIX_WARPS=0); few_rows checks; then g7 beside
# transformers generate in one command each (SmolLM2-135M and Llama-3.2-1B shapes).
set -u
R=$OUT
xz -dc gpubin/kiln-g7.xz > /tmp/kiln-g7 && chmod +x /tmp/kiln-g7
printf '#!/bin/sh\nKILN_GATE_UP_SIX_WARPS=0 exec /tmp/kiln-g7 "$@"\n' > /tmp/kiln-g8; chmod +x /tmp/kiln-g8
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=24,32,64 ROUNDS=3 LIMIT=60 bash bench/ab_decode_speed.sh eight=/tmp/kiln-g8 six=/tmp/kiln-g7 > $R/ab.txt 2>&1
tail -5 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5; echo "t=$(( $(date +%s)-s ))"
timeout 120 /tmp/kiln-g7 selftest --only kernels --match few_rows > $R/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks," $R/selftest.log; grep -E "FAIL" $R/selftest.log | head -10
timeout 200 /tmp/kiln-g7 bench generate --shape smollm2-135m --batches 1,8,64 --out $R/hf-smollm2 > $R/hf-smollm2.log 2>&1; echo "hf smollm2 rc $? t=$(( $(date +%s)-s ))"
grep -iE "decode|batch" $R/hf-smollm2.log | tail -12
timeout 150 /tmp/kiln-g7 bench generate --shape llama-3.2-1b --batches 1,64 --out $R/hf-llama > $R/hf-llama.log 2>&1; echo "hf llama rc $? t=$(( $(date +%s)-s ))"
grep -iE "decode|batch" $R/hf-llama.log | tail -10
rm -f $R/hf-*/*.png
