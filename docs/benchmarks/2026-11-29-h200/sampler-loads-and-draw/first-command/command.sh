#!/usr/bin/env bash
# Two prepared sampler changes against main (2bee325): vec (runs of 8 ids a thread in one
# 16-byte load) and dis (the select stage draws the token itself); kernel caches filled,
# `kiln bench generate --no-python` alternating, two rounds; then the kernel selftest of dis.
set -u
R=$OUT
for b in main vec dis; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m,llama-3.2-1b BATCHES=1,8,32,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh main=/tmp/kiln-main vec=/tmp/kiln-vec dis=/tmp/kiln-dis > $R/ab.txt 2>&1
tail -12 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5; echo "t=$(( $(date +%s)-s ))"
timeout 250 /tmp/kiln-dis selftest --only kernels > $R/selftest-dis.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks," $R/selftest-dis.log | tail -2; grep -E "FAIL" $R/selftest-dis.log | head -20
