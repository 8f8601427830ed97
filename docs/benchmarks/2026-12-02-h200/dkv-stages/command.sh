#!/usr/bin/env bash
# dK/dV with four or five stages, two tiles or three copied ahead (trial entry points chosen by
# KILN_ATTENTION_DKV_STAGES), against the kept three in one build (`kiln-st`): the attention
# kernel checks with each (lines diffed against three's), then `kiln bench kernels` B 4, T 4096
# at head sizes 64 and 128, alternating, two rounds.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-st.xz > /tmp/kiln && chmod +x /tmp/kiln
M=attention_forward,attention_backward
for st in 3 4 5; do
  KILN_ATTENTION_DKV_STAGES=$st timeout 200 /tmp/kiln selftest --only kernels --match $M > $R/selftest-s$st.log 2>&1
  echo "selftest s$st rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-s$st.log)"
done
for st in 4 5; do
  diff <(grep -E "PASS|FAIL" $R/selftest-s3.log) <(grep -E "PASS|FAIL" $R/selftest-s$st.log) > $R/selftest-diff-s$st.txt
  echo "s$st: lines differing from s3: $(grep -c '^<' $R/selftest-diff-s$st.txt)"; head -4 $R/selftest-diff-s$st.txt
done
bench() {  # tag, stages, channels, heads
  [ $(( $(date +%s)-s )) -gt 300 ] && { echo "$1 skipped (time)"; return; }
  KILN_ATTENTION_DKV_STAGES=$2 timeout 60 /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 --channels $3 --heads $4 --no-python --reps 10 --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_backward ' $R/$1.log | head -2 | awk '{print $1, $2, $7}' | paste -sd' ')"
}
for round in 1 2; do for st in 3 4 5; do
  bench hs64-s$st-r$round $st 768 12
  bench hs128-s$st-r$round $st 2048 16
done; done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
