#!/usr/bin/env bash
# Which of the backward's two kernels gains from register A operands: old (none), v1 (dQ's
# both tiles at head sizes 64 and 128), v2 (dK/dV's: both at 64, K at 128), new (both kernels).
# Kernel checks of v1 and v2 against old's lines, then `kiln bench kernels` T 4096, alternating.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
for v in old v1 v2 new; do xz -dc gpubin/kiln-$v.xz > /tmp/kiln-$v && chmod +x /tmp/kiln-$v; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=attention_forward,attention_backward
for v in v1 v2 old; do
  timeout 300 /tmp/kiln-$v selftest --only kernels --match $M > $R/selftest-$v.log 2>&1; echo "selftest $v rc $? t=$(( $(date +%s)-s ))"
done
for v in v1 v2; do
  diff <(grep -E "PASS|FAIL" $R/selftest-old.log) <(grep -E "PASS|FAIL" $R/selftest-$v.log) > $R/selftest-diff-$v.txt; echo "$v: $(grep -E 'checks,' $R/selftest-$v.log); lines differing from old: $(grep -c '^<' $R/selftest-diff-$v.txt)"
done
for round in 1 2; do
  order="old v1 v2 new"; [ $round = 2 ] && order="new v2 v1 old"
  for v in $order; do
    for shape in "--channels 768 --heads 12" "--channels 2048 --heads 16"; do
      tag=$v-r$round-c$(echo "$shape" | awk '{print $2}')
      timeout 200 /tmp/kiln-$v bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 $shape --no-python --reps 10 --out $R/$tag > $R/$tag.log 2>&1
      echo "$tag rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_backward ' $R/$tag.log | awk '{print $2, $7}' | paste -sd' ')"
    done
  done
done
rm -f $R/*/*.png
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
