#!/usr/bin/env bash
# One binary: products of up to 8 rows that add into their output load its old values before
# their loop (ea), against the same binary with KILN_FEW_ROWS_EARLY_ACCUMULATE=0 (late, as
# main); alternating, three rounds; few_rows checks under both.
set -u
R=$OUT
xz -dc gpubin/kiln-ea.xz > /tmp/kiln-ea && chmod +x /tmp/kiln-ea
printf '#!/bin/sh\nKILN_FEW_ROWS_EARLY_ACCUMULATE=0 exec /tmp/kiln-ea "$@"\n' > /tmp/kiln-late; chmod +x /tmp/kiln-late
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m,llama-3.2-1b BATCHES=1,8,64 ROUNDS=3 LIMIT=60 bash bench/ab_decode_speed.sh late=/tmp/kiln-late early=/tmp/kiln-ea > $R/ab.txt 2>&1
tail -7 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5; echo "t=$(( $(date +%s)-s ))"
timeout 100 /tmp/kiln-ea selftest --only kernels --match few_rows > $R/selftest-early.log 2>&1; echo "selftest early rc $? t=$(( $(date +%s)-s ))"
timeout 100 /tmp/kiln-late selftest --only kernels --match few_rows > $R/selftest-late.log 2>&1; echo "selftest late rc $? t=$(( $(date +%s)-s ))"
grep -E "checks," $R/selftest-*.log; grep -E "FAIL" $R/selftest-*.log | head -10
diff <(grep few_rows $R/selftest-early.log | sed 's/[0-9.]* *ms//g') <(grep few_rows $R/selftest-late.log | sed 's/[0-9.]* *ms//g') > $R/selftest-diff.txt; echo "selftest diff lines: $(wc -l < $R/selftest-diff.txt)"
