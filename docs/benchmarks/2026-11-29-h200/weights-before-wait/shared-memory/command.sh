#!/usr/bin/env bash
# The few-row products' first weights copied into shared memory (cp.async) before their wait
# (cp) against the build before (att, 71a3b32): kernel caches filled in parallel, `kiln bench
# generate --no-python` (128 new tokens) alternating, two rounds; the selftest and fp32 greedy
# parity of cp only where it came out faster at SmolLM2-135M's batch 1.
set -u
B="att cp"
for b in $B; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
for b in $B; do
  (timeout 200 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 1 --new-tokens 8 --no-python --out /tmp/warm-$b > /tmp/warm-$b.log 2>&1; echo "$b warm rc $? t=$(( $(date +%s)-s ))"; tail -3 /tmp/warm-$b.log | grep -iE "error|panic") &
done
wait
run() { # build shape round
  timeout 45 /tmp/kiln-$1 bench generate --shape $2 --batches 1,8,16,32,64 --new-tokens 128 --no-python --out /tmp/bg-$1-$2 > /tmp/$1-$2-r$3.log 2>&1
  echo "$1 $2 r$3 rc $? t=$(( $(date +%s)-s )) $(grep -E '^kiln batch' /tmp/$1-$2-r$3.log | sed -E 's/.*batch ([0-9]+).*decode ([0-9.]+[k]?).*/b\1=\2/' | tr '\n' ' ')"
  grep -iE "error|panic" /tmp/$1-$2-r$3.log | head -3
}
for r in 1 2; do for sh in smollm2-135m llama-3.2-1b; do for b in $B; do run $b $sh $r; done; done; done
b1() { grep -E '^kiln batch 1:' /tmp/$1-smollm2-135m-r1.log | sed -E 's/.*decode ([0-9]+).*/\1/'; }
a=$(b1 att); c=$(b1 cp); echo "batch 1: att $a cp $c"
if [ "${c:-0}" -gt $(( ${a:-0} * 102 / 100 )) ]; then
  timeout 230 /tmp/kiln-cp selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
  grep -E "checks in all" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head -20
  grep -E "^few_rows" $OUT/selftest.log | head -40
  left=$(( 480 - ($(date +%s)-s) ))
  [ $left -gt 40 ] && { timeout $left python3 bench/llama_parity.py --kiln /tmp/kiln-cp --tokenizer gpubin/tok --work /tmp/pl --only smollm2-135m > $OUT/parity.log 2>&1; echo "parity rc $? t=$(( $(date +%s)-s ))"; grep -E "^\|" $OUT/parity.log | tail -2; }
fi
