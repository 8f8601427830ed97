#!/usr/bin/env bash
# stg2: the staged gate/up kernel with each warp copying whole rows (no division a piece),
# against main and against itself with KILN_FEW_ROWS_STAGED=0; few_rows checks of both forms;
# then main beside transformers generate in one command (SmolLM2-135M and Llama-3.2-1B shapes).
set -u
R=$OUT
for b in main stg2; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
printf '#!/bin/sh\nKILN_FEW_ROWS_STAGED=0 exec /tmp/kiln-stg2 "$@"\n' > /tmp/kiln-stg20; chmod +x /tmp/kiln-stg20
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,48,64 ROUNDS=3 LIMIT=60 bash bench/ab_decode_speed.sh main=/tmp/kiln-main reg=/tmp/kiln-stg20 stg2=/tmp/kiln-stg2 > $R/ab.txt 2>&1
tail -4 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5; echo "t=$(( $(date +%s)-s ))"
timeout 120 /tmp/kiln-stg2 selftest --only kernels --match few_rows > $R/selftest-staged.log 2>&1; echo "selftest staged rc $? t=$(( $(date +%s)-s ))"
timeout 120 /tmp/kiln-stg20 selftest --only kernels --match few_rows > $R/selftest-registers.log 2>&1; echo "selftest registers rc $? t=$(( $(date +%s)-s ))"
grep -E "checks," $R/selftest-*.log; grep -E "FAIL" $R/selftest-*.log | head -10
diff <(grep few_rows $R/selftest-staged.log | sed 's/[0-9.]* *ms//g') <(grep few_rows $R/selftest-registers.log | sed 's/[0-9.]* *ms//g') > $R/selftest-diff.txt; echo "selftest diff lines: $(wc -l < $R/selftest-diff.txt)"
timeout 200 /tmp/kiln-main bench generate --shape smollm2-135m --batches 1,8,64 --out $R/hf-smollm2 > $R/hf-smollm2.log 2>&1; echo "hf smollm2 rc $? t=$(( $(date +%s)-s ))"
grep -iE "decode|batch" $R/hf-smollm2.log | tail -12
timeout 150 /tmp/kiln-main bench generate --shape llama-3.2-1b --batches 1,64 --out $R/hf-llama > $R/hf-llama.log 2>&1; echo "hf llama rc $? t=$(( $(date +%s)-s ))"
grep -iE "decode|batch" $R/hf-llama.log | tail -10
rm -f $R/hf-*/*.png
