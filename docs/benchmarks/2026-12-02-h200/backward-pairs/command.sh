#!/usr/bin/env bash
# The backward kernels with two warpgroups a block sharing the streamed tiles
# (KILN_ATTENTION_BACKWARD_G2 names which), against the one-warpgroup kernels, in one binary:
# attention kernel checks in each mode (lines diffed against the default's), then
# `kiln bench kernels` B 4, T 4096, head size 128 (16 heads) and 64 (12 heads), modes alternating.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-g2.xz > /tmp/kiln && chmod +x /tmp/kiln
M=attention_forward,attention_backward
for mode in default all dkv128tma; do
  g2=""; [ $mode = all ] && g2="dq64,dkv64,dq128,dkv128"; [ $mode = dkv128tma ] && g2="dkv128tma"
  KILN_ATTENTION_BACKWARD_G2=$g2 timeout 200 /tmp/kiln selftest --only kernels --match $M > $R/selftest-$mode.log 2>&1
  echo "selftest $mode rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-$mode.log)"
done
for mode in all dkv128tma; do
  diff <(grep -E "PASS|FAIL" $R/selftest-default.log) <(grep -E "PASS|FAIL" $R/selftest-$mode.log) > $R/selftest-diff-$mode.txt
  echo "$mode: lines differing from default: $(grep -c '^<' $R/selftest-diff-$mode.txt)"; head -6 $R/selftest-diff-$mode.txt
done
bench() {  # tag, G2 list, channels, heads
  [ $(( $(date +%s)-s )) -gt 520 ] && { echo "$1 skipped (time)"; return; }
  KILN_ATTENTION_BACKWARD_G2=$2 timeout 60 /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 --channels $3 --heads $4 --no-python --reps 10 --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_(forward|backward) ' $R/$1.log | awk '{print $1, $2, $7}' | paste -sd' ')"
}
for round in 1 2; do
  for mode in base dq128 dkv128 dkv128tma dq128+dkv128 dq128+dkv128tma; do
    g2=${mode/base/}; bench hs128-$mode-r$round "${g2/+/,}" 2048 16
  done
  for mode in base dkv64 dq64 dq64+dkv64; do
    g2=${mode/base/}; bench hs64-$mode-r$round "${g2/+/,}" 768 12
  done
done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
