#!/usr/bin/env bash
# Overlapped launches (programmatic dependent launch) in the decode step. Kernel selftest of the
# new build (fills its kernel cache; checks the overlapped chain) while the previous build
# (b1379b1) fills its own cache, then `kiln bench generate --no-python` at batches 1-64, 128 new
# tokens: previous build, new build with KILN_OVERLAPPED_LAUNCHES=0, new build with overlap on.
set -u
for b in base pdl; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
(timeout 280 /tmp/kiln-base bench generate --shape smollm2-135m --batches 1 --new-tokens 8 --no-python --out /tmp/warm > /tmp/warm.log 2>&1; echo "base warm rc $? t=$(( $(date +%s)-s ))") &
timeout 300 /tmp/kiln-pdl selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
wait
grep -E "checks in all" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head -20
grep -E "^few_rows" $OUT/selftest.log
run() { # name binary env shape
  env KILN_OVERLAPPED_LAUNCHES=$3 timeout 60 /tmp/kiln-$2 bench generate --shape $4 --batches 1,8,16,32,64 --new-tokens 128 --no-python --out /tmp/bg-$1-$4 > $OUT/$1-$4-r$5.log 2>&1
  echo "$1 $4 r$5 rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch|graph" $OUT/$1-$4-r$5.log; grep -rh "graphs off" /tmp/bg-$1-$4 2>/dev/null | head -2
}
for r in 1 2; do
  for sh in smollm2-135m llama-3.2-1b; do
    run base base 1 $sh $r; run off pdl 0 $sh $r; run on pdl 1 $sh $r
  done
  [ $(( $(date +%s)-s )) -gt 420 ] && break
done
