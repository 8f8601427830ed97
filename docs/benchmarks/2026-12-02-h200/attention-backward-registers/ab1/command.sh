#!/usr/bin/env bash
# The backward's S and dP products with the block's own tiles as register A operands (new)
# against both operands from shared memory (old): kernel checks both ways (same seed), then
# `kiln bench kernels` at T 4096, head sizes 64 and 128, bf16 and f16, alternating.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
for v in old new; do xz -dc gpubin/kiln-$v.xz > /tmp/kiln-$v && chmod +x /tmp/kiln-$v; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=attention_forward,attention_backward
for v in new old; do
  timeout 300 /tmp/kiln-$v selftest --only kernels --match $M > $R/selftest-$v.log 2>&1; echo "selftest $v rc $? t=$(( $(date +%s)-s ))"
done
grep -E "checks,|FAIL" $R/selftest-new.log $R/selftest-old.log | head
diff <(grep -E "PASS|FAIL" $R/selftest-old.log) <(grep -E "PASS|FAIL" $R/selftest-new.log) > $R/selftest-diff.txt; echo "check lines differing: $(grep -c '^<' $R/selftest-diff.txt) of $(grep -cE 'PASS|FAIL' $R/selftest-new.log)"
for round in 1 2; do
  order="old new"; [ $round = 2 ] && order="new old"
  for v in $order; do
    for shape in "--channels 768 --heads 12" "--channels 2048 --heads 16"; do
      tag=$v-r$round-c$(echo "$shape" | awk '{print $2}')
      timeout 200 /tmp/kiln-$v bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 $shape --no-python --reps 10 --out $R/$tag > $R/$tag.log 2>&1
      echo "$tag rc $? t=$(( $(date +%s)-s ))"
      grep -E "^attention_(forward|backward) " $R/$tag.log | awk '{print $1, $2, $7}' | paste -sd' '
    done
  done
done
rm -f $R/*/*.png
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
