#!/usr/bin/env bash
# The batch-64 gate/up product in 6-warp blocks (one round of loads) against 8-warp blocks, one
# binary (KILN_GATE_UP_SIX_WARPS=0 for the latter); few_rows checks under both settings.
set -u
R=$OUT
xz -dc gpubin/kiln-g6.xz > /tmp/kiln-g6 && chmod +x /tmp/kiln-g6
printf '#!/bin/sh\nKILN_GATE_UP_SIX_WARPS=0 exec /tmp/kiln-g6 "$@"\n' > /tmp/kiln-g8; chmod +x /tmp/kiln-g8
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=48,64 ROUNDS=3 LIMIT=60 bash bench/ab_decode_speed.sh eight=/tmp/kiln-g8 six=/tmp/kiln-g6 > $R/ab.txt 2>&1
tail -4 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5; echo "t=$(( $(date +%s)-s ))"
timeout 120 /tmp/kiln-g6 selftest --only kernels --match few_rows > $R/selftest-six.log 2>&1; echo "selftest six rc $? t=$(( $(date +%s)-s ))"
timeout 120 /tmp/kiln-g8 selftest --only kernels --match few_rows > $R/selftest-eight.log 2>&1; echo "selftest eight rc $? t=$(( $(date +%s)-s ))"
grep -E "checks," $R/selftest-*.log; grep -E "FAIL" $R/selftest-*.log | head -10
grep -E "swiglu" $R/selftest-six.log | head -20
