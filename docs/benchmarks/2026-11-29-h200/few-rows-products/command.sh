#!/usr/bin/env bash
# Kernel selftest of the new build (few-row products, rows split over blocks of 8 or 16; its first
# start compiles the kernel cache), then `kiln bench generate --no-python` at batches 1, 8, 64 with
# the previous build (base, b1379b1) and this one alternating.
set -u
for b in base rows; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
timeout 215 /tmp/kiln-rows selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head -20
grep -E "^few_rows" $OUT/selftest.log
for sh in smollm2-135m llama-3.2-1b; do
  for b in base rows; do
    timeout 20 /tmp/kiln-$b bench generate --shape $sh --batches 1,8,64 --new-tokens 64 --no-python --out /tmp/bg-$b-$sh > /tmp/$b-$sh.log 2>&1
    echo "$b $sh rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" /tmp/$b-$sh.log
  done
done
