#!/usr/bin/env bash
# f16's backward with its dS scales fixed before the loops (`kiln-fix`: the head's largest |V_j|
# from attention_value_bound, no per-tile refitting in dQ, one scale a head in dK/dV) against
# the build before (`kiln-new`): attention kernel checks of both (lines diffed), `kiln bench
# kernels` B 4, T 4096 at head sizes 64 and 128 alternating, then the kept build beside SDPA
# replayed from CUDA graphs at T 1024, 4096 and 8192.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in new fix; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
M=attention_forward,attention_backward
for b in new fix; do for tma in 1 0; do
  KILN_ATTENTION_TMA=$tma timeout 200 /tmp/kiln-$b selftest --only kernels --match $M > $R/selftest-$b-tma$tma.log 2>&1
  echo "selftest $b tma$tma rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-$b-tma$tma.log)"
done; done
for tma in 1 0; do
  diff <(grep -E "PASS|FAIL" $R/selftest-new-tma$tma.log) <(grep -E "PASS|FAIL" $R/selftest-fix-tma$tma.log) > $R/selftest-diff-tma$tma.txt
  echo "tma$tma: lines differing: $(grep -c '^<' $R/selftest-diff-tma$tma.txt), of them f16: $(grep '^<' $R/selftest-diff-tma$tma.txt | grep -c f16)"
done
grep -E "f16" $R/selftest-diff-tma1.txt | head -40
bench() {  # tag, binary, channels, heads
  [ $(( $(date +%s)-s )) -gt 330 ] && { echo "$1 skipped (time)"; return; }
  timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 --channels $3 --heads $4 --no-python --reps 10 --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_(forward|backward) ' $R/$1.log | head -4 | awk '{print $1, $2, $7}' | paste -sd' ')"
}
for round in 1 2; do for b in new fix; do
  bench hs64-$b-r$round $b 768 12
  bench hs128-$b-r$round $b 2048 16
done; done
for c in 768:12 2048:16; do for seq in 1024 4096 8192; do
  [ $(( $(date +%s)-s )) -gt 540 ] && { echo "sdpa $c $seq skipped (time)"; continue; }
  tag=sdpa-t$seq-c${c%:*}
  timeout 100 /tmp/kiln-fix bench kernels --only compute --dtypes bf16,f16 --seq $seq --rows $((4 * seq)) --channels ${c%:*} --heads ${c#*:} --reps 10 --out $R/$tag > $R/$tag.log 2>&1
  echo "$tag rc $? t=$(( $(date +%s)-s ))"
  grep -E "^\| attention" $R/$tag/report.md | awk -F'|' '{print $2,$3,$6,$10,$11}'
done; done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
