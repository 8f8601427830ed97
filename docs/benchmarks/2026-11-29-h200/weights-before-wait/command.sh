#!/usr/bin/env bash
# The few-row products' first round of weight loads before their wait (w) against the build
# before (att, 71a3b32): kernel caches filled in parallel, `kiln bench generate --no-python`
# (128 new tokens) alternating, two rounds; the kernel selftest and fp32 greedy parity of w;
# then w's `kiln bench generate` with transformers generate beside, SmolLM2-135M.
set -u
B="att w"
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
timeout 250 /tmp/kiln-w selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head -20
grep -E "^few_rows" $OUT/selftest.log | head -40
timeout 100 python3 bench/llama_parity.py --kiln /tmp/kiln-w --tokenizer gpubin/tok --work /tmp/pl --only smollm2-135m > $OUT/parity.log 2>&1; echo "parity rc $? t=$(( $(date +%s)-s ))"; grep -E "^\|" $OUT/parity.log | tail -2; grep -E "rror|Trace" $OUT/parity.log | head -5
left=$(( 590 - ($(date +%s)-s) ))
[ $left -gt 60 ] && { timeout $left /tmp/kiln-w bench generate --shape smollm2-135m --batches 1,8,64 --new-tokens 128 --out $OUT/bench-hf > /tmp/hf.log 2>&1; echo "bench-hf rc $? t=$(( $(date +%s)-s ))"; grep -E "^(kiln|transformers|hf|  )" /tmp/hf.log | head -20; tail -25 /tmp/hf.log; }
