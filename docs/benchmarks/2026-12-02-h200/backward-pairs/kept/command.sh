#!/usr/bin/env bash
# The kept build (`kiln-new`: dK/dV at head size 64 with two warpgroups a block, both forms)
# against the trial build (`kiln-g2`, whose defaults are the one-warpgroup kernels):
# 1. attention kernel checks of both, defaults and KILN_ATTENTION_TMA=0, lines diffed;
# 2. the threads' copies (KILN_ATTENTION_TMA=0) at head size 64, B 4, T 4096, alternating;
# 3. f16 without P's and dS's scales (KILN_ATTENTION_F16_PLAIN, a timing probe in this build
#    only: what the scaling costs), head sizes 64 and 128;
# 4. the kept build beside SDPA replayed from CUDA graphs at head size 64, T 1024 to 8192.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in g2 new; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
M=attention_forward,attention_backward
for b in g2 new; do for tma in 1 0; do
  KILN_ATTENTION_TMA=$tma timeout 200 /tmp/kiln-$b selftest --only kernels --match $M > $R/selftest-$b-tma$tma.log 2>&1
  echo "selftest $b tma$tma rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-$b-tma$tma.log)"
done; done
for tma in 1 0; do
  diff <(grep -E "PASS|FAIL" $R/selftest-g2-tma$tma.log) <(grep -E "PASS|FAIL" $R/selftest-new-tma$tma.log) > $R/selftest-diff-tma$tma.txt
  echo "tma$tma: lines differing: $(grep -c '^<' $R/selftest-diff-tma$tma.txt)"; head -6 $R/selftest-diff-tma$tma.txt
done
bench() {  # tag, binary, env, channels, heads, dtypes
  [ $(( $(date +%s)-s )) -gt 500 ] && { echo "$1 skipped (time)"; return; }
  env $3 timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes $6 --seq 4096 --rows 16384 --channels $4 --heads $5 --no-python --reps 10 --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_(forward|backward) ' $R/$1.log | head -4 | awk '{print $1, $2, $7}' | paste -sd' ')"
}
for round in 1 2; do
  for b in g2 new; do bench tma0-hs64-$b-r$round $b KILN_ATTENTION_TMA=0 768 12 bf16,f16; done
done
for round in 1 2; do
  for p in none dq dkv dq,dkv; do
    bench plain-hs64-${p/,/+}-r$round new KILN_ATTENTION_F16_PLAIN=$p 768 12 f16
    bench plain-hs128-${p/,/+}-r$round new KILN_ATTENTION_F16_PLAIN=$p 2048 16 f16
  done
done
for seq in 1024 4096 8192; do
  [ $(( $(date +%s)-s )) -gt 520 ] && { echo "sdpa $seq skipped (time)"; continue; }
  tag=sdpa-t$seq-c768
  timeout 100 /tmp/kiln-new bench kernels --only compute --dtypes bf16,f16 --seq $seq --rows $((4 * seq)) --channels 768 --heads 12 --reps 10 --out $R/$tag > $R/$tag.log 2>&1
  echo "$tag rc $? t=$(( $(date +%s)-s ))"
  grep -E "^\| attention" $R/$tag/report.md | awk -F'|' '{print $2,$3,$6,$10,$11}'
done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
