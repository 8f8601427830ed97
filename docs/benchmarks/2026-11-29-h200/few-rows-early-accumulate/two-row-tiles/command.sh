#!/usr/bin/env bash
# head (a4d9e81: early accumulate in products of one row tile) against eall, whose products of
# two row tiles can load early too: eall as it starts (late there) and with
# KILN_FEW_ROWS_EARLY_ACCUMULATE=all (early there); alternating, three rounds; few_rows checks
# with all.
set -u
R=$OUT
for b in head eall; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
printf '#!/bin/sh\nKILN_FEW_ROWS_EARLY_ACCUMULATE=all exec /tmp/kiln-eall "$@"\n' > /tmp/kiln-all; chmod +x /tmp/kiln-all
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=32,64 ROUNDS=3 LIMIT=40 bash bench/ab_decode_speed.sh head=/tmp/kiln-head eall=/tmp/kiln-eall all=/tmp/kiln-all > $R/ab.txt 2>&1
tail -3 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5; echo "t=$(( $(date +%s)-s ))"
timeout 60 /tmp/kiln-all selftest --only kernels --match few_rows > $R/selftest-all.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks," $R/selftest-all.log; grep -E "FAIL" $R/selftest-all.log | head -5
