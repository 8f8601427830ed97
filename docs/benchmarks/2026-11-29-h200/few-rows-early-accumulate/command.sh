#!/usr/bin/env bash
# main (06084ed) against ear (the few-row products load their accumulate input before the
# loop): kernel caches filled, `kiln bench generate --no-python` alternating, two rounds; the
# few_rows kernel checks of ear; then one batch-64 decode step of main under Nsight Compute
# with warp-stall reasons (bench/decode_profile.sh).
set -u
R=$OUT
for b in main ear; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,8,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh main=/tmp/kiln-main ear=/tmp/kiln-ear > $R/ab.txt 2>&1
tail -4 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5; echo "t=$(( $(date +%s)-s ))"
OUT=/tmp/ab2 SHAPES=llama-3.2-1b BATCHES=1,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh main=/tmp/kiln-main ear=/tmp/kiln-ear > $R/ab-llama.txt 2>&1
tail -3 $R/ab-llama.txt; echo "t=$(( $(date +%s)-s ))"
timeout 150 /tmp/kiln-ear selftest --only kernels --match few_rows > $R/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks," $R/selftest.log | tail -2; grep -E "FAIL" $R/selftest.log | head -20
timeout 200 bash bench/decode_profile.sh /tmp/kiln-main smollm2-135m 64 $R/profile > $R/profile.txt 2>&1; echo "profile rc $? t=$(( $(date +%s)-s ))"
head -c 3000 $R/profile.txt; rm -f $R/profile/ncu.csv.gz; gzip -k $R/profile/ncu.csv 2>/dev/null; rm -f $R/profile/ncu.csv
