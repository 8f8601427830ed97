#!/usr/bin/env bash
# main (2bee325), vec (runs of 8 ids a thread in one 16-byte load) and vdis (vec, and the select
# stage drawing the token itself in calls of 32 rows or more): kernel caches filled,
# `kiln bench generate --no-python` alternating, two rounds; then the kernel selftest of vdis.
set -u
R=$OUT
for b in main vec vdis; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,8,32,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh main=/tmp/kiln-main vec=/tmp/kiln-vec vdis=/tmp/kiln-vdis > $R/ab.txt 2>&1
tail -4 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5; echo "t=$(( $(date +%s)-s ))"
OUT=/tmp/ab2 SHAPES=llama-3.2-1b BATCHES=1,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh main=/tmp/kiln-main vec=/tmp/kiln-vec vdis=/tmp/kiln-vdis > $R/ab-llama.txt 2>&1
tail -2 $R/ab-llama.txt; echo "t=$(( $(date +%s)-s ))"
timeout 330 /tmp/kiln-vdis selftest --only kernels > $R/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks," $R/selftest.log | tail -2; grep -E "FAIL" $R/selftest.log | head -20
