#!/usr/bin/env bash
# The kept configuration (register A operands: dK/dV's at head size 64; dQ's and dK/dV's K at
# 128) against the previous build at T 1024 and 8192 (B 4 T 4096 is in ab1/ab2), kernel checks
# both ways, then SDPA beside the kept build at T 1024, 4096 and 8192 (bf16 and f16, 12 heads
# of 64 and 16 of 128).
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
for v in old final; do xz -dc gpubin/kiln-$v.xz > /tmp/kiln-$v && chmod +x /tmp/kiln-$v; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=attention_forward,attention_backward
for v in final old; do
  timeout 300 /tmp/kiln-$v selftest --only kernels --match $M > $R/selftest-$v.log 2>&1; echo "selftest $v rc $? t=$(( $(date +%s)-s ))"
done
diff <(grep -E "PASS|FAIL" $R/selftest-old.log) <(grep -E "PASS|FAIL" $R/selftest-final.log) > $R/selftest-diff.txt; echo "final: $(grep -E 'checks,' $R/selftest-final.log); lines differing from old: $(grep -c '^<' $R/selftest-diff.txt)"
for seq in 1024 8192; do
  for v in old final; do
    for shape in "--channels 768 --heads 12" "--channels 2048 --heads 16"; do
      tag=$v-t$seq-c$(echo "$shape" | awk '{print $2}')
      timeout 200 /tmp/kiln-$v bench kernels --only compute --dtypes bf16,f16 --seq $seq --rows $((4 * seq)) $shape --no-python --reps 10 --out $R/$tag > $R/$tag.log 2>&1
      echo "$tag rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_backward ' $R/$tag.log | awk '{print $2, $7}' | paste -sd' ')"
    done
  done
done
for seq in 1024 4096 8192; do
  for shape in "--channels 768 --heads 12" "--channels 2048 --heads 16"; do
    tag=sdpa-t$seq-c$(echo "$shape" | awk '{print $2}')
    timeout 240 /tmp/kiln-final bench kernels --only compute --dtypes bf16,f16 --seq $seq --rows $((4 * seq)) $shape --out $R/$tag > $R/$tag.log 2>&1
    echo "$tag rc $? t=$(( $(date +%s)-s ))"
    grep -E "^attention.*x$" $R/$tag.log | head -6
  done
done
rm -f $R/*/*.png
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
