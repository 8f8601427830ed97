#!/usr/bin/env bash
# The fused gate/up few-row kernel of 16-row blocks bounded to three blocks an SM (lb3: 80
# registers, one wave at SmolLM2-135M's batch 64) against the build before it (pdl2, 29e9f37),
# both with overlapped launches: both fill their kernel caches in parallel, then `kiln bench
# generate --no-python` at batches 1-64, 128 new tokens, alternating, two rounds; then the new
# build's kernel selftest.
set -u
for b in pdl2 lb3; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
for b in pdl2 lb3; do
  (timeout 280 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 1 --new-tokens 8 --no-python --out /tmp/warm-$b > /tmp/warm-$b.log 2>&1; echo "$b warm rc $? t=$(( $(date +%s)-s ))") &
done
wait
run() { # build shape round
  timeout 60 /tmp/kiln-$1 bench generate --shape $2 --batches 1,8,16,32,64 --new-tokens 128 --no-python --out /tmp/bg-$1-$2 > $OUT/$1-$2-r$3.log 2>&1
  echo "$1 $2 r$3 rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" $OUT/$1-$2-r$3.log | sed 's/prefill.*decode/decode/'; grep -rh "graphs off" /tmp/bg-$1-$2 2>/dev/null | head -2
}
for r in 1 2; do
  for sh in smollm2-135m llama-3.2-1b; do
    if [ $r = 1 ]; then run pdl2 $sh $r; run lb3 $sh $r; else run lb3 $sh $r; run pdl2 $sh $r; fi
  done
done
timeout 250 /tmp/kiln-lb3 selftest --only kernels > /tmp/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" /tmp/selftest.log | tail -2; grep -E "FAIL" /tmp/selftest.log | head -20
grep -E "^few_rows_swiglu|^few_rows chain" /tmp/selftest.log
