#!/usr/bin/env bash
# The one-warpgroup Hopper attention forward with two stages (three blocks an SM at head size
# 128): the harness's checks and times beside SDPA.
set -u
R=$OUT
s=$(date +%s)
OUT=$R timeout 400 bash bench/wgmma_attention/run.sh > $R/run.log 2>&1; echo "harness rc $? t=$(( $(date +%s)-s ))"
grep -E "worst vs cpu|checks:|WARNING|FAIL|spills" $R/run.log | head -20
grep -E "_s2 |_s2q " $R/harness.txt | grep -E "blocks/SM" | head -8
grep -E "wg_.*_s2q? " $R/harness.txt | grep -E "= n|DIFFERS" | head -8
grep -c "DIFFERS" $R/harness.txt
cat $R/summary.txt
