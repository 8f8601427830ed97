#!/usr/bin/env bash
# Current build's kernel selftest (CPU attention reference changed, tf32 backward refactored),
# then the warp-specialised forward harness beside wg_forward and SDPA.
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
gunzip -c gpubin/kiln-cur.gz > /tmp/kiln; chmod +x /tmp/kiln
s=$(date +%s)
timeout 240 /tmp/kiln selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -iE "fail|checks|summary" $OUT/selftest.log | tail -8
timeout 330 bash bench/wgmma_attention/run.sh; echo "harness rc $? t=$(( $(date +%s)-s ))"
grep -E "ws_|FAIL|C7520" $OUT/harness.txt | tail -40
cat $OUT/summary.txt | tail -40
