#!/usr/bin/env bash
# The TMA-fed attention backward (and forward) against the cp.async forms, one binary:
# kernel checks both ways (same seed: identical errors mean identical outputs), then
# `kiln bench kernels` T 4096 at head sizes 64 and 128 alternating, then SDPA beside the TMA form.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln
K=/tmp/kiln
M=attention_forward,attention_backward
timeout 300 $K selftest --only kernels --match $M > $R/selftest-tma1.log 2>&1; echo "selftest tma1 rc $? t=$(( $(date +%s)-s ))"
KILN_ATTENTION_TMA=0 timeout 300 $K selftest --only kernels --match $M > $R/selftest-tma0.log 2>&1; echo "selftest tma0 rc $? t=$(( $(date +%s)-s ))"
grep -E "checks,|FAIL" $R/selftest-tma1.log $R/selftest-tma0.log
diff <(grep -E "PASS|FAIL" $R/selftest-tma0.log) <(grep -E "PASS|FAIL" $R/selftest-tma1.log) > $R/selftest-diff.txt; echo "check lines differing: $(grep -c '^<' $R/selftest-diff.txt) of $(grep -cE 'PASS|FAIL' $R/selftest-tma1.log)"
for round in 1 2; do
  for tma in 0 1; do
    for shape in "--channels 768 --heads 12" "--channels 2048 --heads 16"; do
      tag=tma$tma-r$round-c$(echo "$shape" | awk '{print $2}')
      KILN_ATTENTION_TMA=$tma timeout 200 $K bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 $shape --no-python --out $R/$tag > $R/$tag.log 2>&1
      echo "$tag rc $? t=$(( $(date +%s)-s ))"
      grep -E "^attention_(forward|backward) " $R/$tag.log | awk '{print $1, $2, $7, $8}' | paste -sd' '
    done
  done
done
for shape in "--channels 768 --heads 12" "--channels 2048 --heads 16"; do
  tag=sdpa-c$(echo "$shape" | awk '{print $2}')
  timeout 240 $K bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 $shape --out $R/$tag > $R/$tag.log 2>&1
  echo "$tag rc $? t=$(( $(date +%s)-s ))"
  grep -E "^attention" $R/$tag.log | head -12
done
rm -f $R/*/*.png
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
