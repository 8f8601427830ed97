#!/usr/bin/env bash
# The warp-specialised attention forward with the consumers' products in turn (pp): the
# harness's checks and times beside SDPA.
set -u
R=$OUT
s=$(date +%s)
OUT=$R timeout 400 bash bench/wgmma_attention/run.sh > $R/run.log 2>&1; echo "harness rc $? t=$(( $(date +%s)-s ))"
grep -E "worst vs cpu|checks:|WARNING|FAIL|spills" $R/run.log | head -20
grep -E "_pp|engine" $R/run.log | grep -E "worst|= n|DIFFERS" | head -5
grep -c "DIFFERS" $R/harness.txt
cat $R/summary.txt
