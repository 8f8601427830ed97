#!/usr/bin/env bash
# Attention keys/values loaded before the wait (att), plus the one-launch sampler (both), plus
# the norm factor before the wait (norm), against c4c5a0c (base): kernel caches filled in
# parallel, then `kiln bench generate --no-python`, 128 new tokens, alternating, two rounds;
# the kernel selftest and fp32 greedy parity of `both` between the rounds.
set -u
B="base att both norm"
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
for sh in smollm2-135m llama-3.2-1b; do for b in $B; do run $b $sh 1; done; done
grep -E "^kiln batch" /tmp/both-smollm2-135m-r1.log | head -5
timeout 280 /tmp/kiln-both selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head -20
grep -E "one launch" $OUT/selftest.log | awk -F'|' '{print $4}' | sort | uniq -c | head; grep -cE "one launch.*PASS" $OUT/selftest.log
grep -E "cache_attention" $OUT/selftest.log | head -12
timeout 100 python3 bench/llama_parity.py --kiln /tmp/kiln-both --tokenizer gpubin/tok --work /tmp/pl --only smollm2-135m > $OUT/parity.log 2>&1; echo "parity rc $? t=$(( $(date +%s)-s ))"; grep -E "^\|" $OUT/parity.log | tail -4; grep -E "rror|Trace" $OUT/parity.log | head -5
for sh in smollm2-135m llama-3.2-1b; do for b in norm both att base; do
  [ $(( $(date +%s)-s )) -gt 540 ] && break 2
  run $b $sh 2
done; done
