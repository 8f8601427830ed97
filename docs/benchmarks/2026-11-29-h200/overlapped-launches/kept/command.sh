#!/usr/bin/env bash
# Overlapped launches, second form: the few-row kernels prefetch only the head of their weight
# rows, and only when launched overlapped (pdl2), against the first form (pdl1: whole tiles,
# always) and the previous build (b1379b1). All three fill their kernel caches in parallel first.
# Then `kiln bench generate --no-python`, batches 1-64, 128 new tokens; greedy parity of
# SmolLM2-135M with transformers (overlap on); the new build's kernel selftest last.
set -u
for b in base pdl pdl2; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
for b in base pdl pdl2; do
  (timeout 280 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 1 --new-tokens 8 --no-python --out /tmp/warm-$b > /tmp/warm-$b.log 2>&1; echo "$b warm rc $? t=$(( $(date +%s)-s ))") &
done
wait
run() { # name binary env shape round
  env KILN_OVERLAPPED_LAUNCHES=$3 timeout 60 /tmp/kiln-$2 bench generate --shape $4 --batches 1,8,16,32,64 --new-tokens 128 --no-python --out /tmp/bg-$1-$4 > $OUT/$1-$4-r$5.log 2>&1
  echo "$1 $4 r$5 rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" $OUT/$1-$4-r$5.log; grep -rh "graphs off" /tmp/bg-$1-$4 2>/dev/null | head -2
}
for sh in smollm2-135m llama-3.2-1b; do
  run base base 1 $sh 1; run pdl1 pdl 1 $sh 1; run off2 pdl2 0 $sh 1; run on2 pdl2 1 $sh 1
done
timeout 250 /tmp/kiln-pdl2 selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head -20
grep -E "^few_rows" $OUT/selftest.log
timeout 150 python3 bench/llama_parity.py --kiln /tmp/kiln-pdl2 --tokenizer gpubin/tok --work /tmp/pl --only smollm2-135m > $OUT/parity.log 2>&1; echo "parity rc $? t=$(( $(date +%s)-s ))"; tail -15 $OUT/parity.log
for sh in smollm2-135m llama-3.2-1b; do
  [ $(( $(date +%s)-s )) -gt 480 ] && break
  run on2 pdl2 1 $sh 2; run off2 pdl2 0 $sh 2; run pdl1 pdl 1 $sh 2; run base base 1 $sh 2
done
