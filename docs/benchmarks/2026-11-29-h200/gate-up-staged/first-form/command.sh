#!/usr/bin/env bash
# main (06084ed) against stg (SmolLM2-135M's batch-64 gate/up product with its operands staged
# in shared memory) and stg0 (the same binary with KILN_FEW_ROWS_STAGED=0: the register
# kernel): few_rows kernel checks of both forms, `kiln bench generate --no-python` alternating,
# three rounds; then one batch-64 decode step of stg under Nsight Compute with stall reasons.
set -u
R=$OUT
for b in main stg; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
printf '#!/bin/sh\nKILN_FEW_ROWS_STAGED=0 exec /tmp/kiln-stg "$@"\n' > /tmp/kiln-stg0; chmod +x /tmp/kiln-stg0
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,48,64 ROUNDS=3 LIMIT=60 bash bench/ab_decode_speed.sh main=/tmp/kiln-main stg0=/tmp/kiln-stg0 stg=/tmp/kiln-stg > $R/ab.txt 2>&1
tail -5 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5; echo "t=$(( $(date +%s)-s ))"
timeout 120 /tmp/kiln-stg selftest --only kernels --match few_rows > $R/selftest-staged.log 2>&1; echo "selftest staged rc $? t=$(( $(date +%s)-s ))"
timeout 120 /tmp/kiln-stg0 selftest --only kernels --match few_rows > $R/selftest-registers.log 2>&1; echo "selftest registers rc $? t=$(( $(date +%s)-s ))"
grep -E "checks," $R/selftest-*.log; grep -E "FAIL" $R/selftest-*.log | head -10
diff <(grep few_rows $R/selftest-staged.log | sed 's/[0-9.]* *ms//g') <(grep few_rows $R/selftest-registers.log | sed 's/[0-9.]* *ms//g') > $R/selftest-diff.txt; echo "selftest diff lines: $(wc -l < $R/selftest-diff.txt)"
timeout 200 bash bench/decode_profile.sh /tmp/kiln-stg smollm2-135m 64 $R/profile > $R/profile.txt 2>&1; echo "profile rc $? t=$(( $(date +%s)-s ))"
head -c 2500 $R/profile.txt; gzip $R/profile/ncu.csv
