#!/usr/bin/env bash
# dQ at head size 128 streaming 64-key tiles (its Q and dO in registers leave the shared memory
# for them) against 32-key tiles (`base`: the build before), kernel checks both ways, then
# `kiln bench kernels` B 4 at T 1024, 4096 and 8192, alternating.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
for v in base dq64; do xz -dc gpubin/kiln-$v.xz > /tmp/kiln-$v && chmod +x /tmp/kiln-$v; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=attention_forward,attention_backward
for v in dq64 base; do
  timeout 300 /tmp/kiln-$v selftest --only kernels --match $M > $R/selftest-$v.log 2>&1; echo "selftest $v rc $? t=$(( $(date +%s)-s ))"
done
diff <(grep -E "PASS|FAIL" $R/selftest-base.log) <(grep -E "PASS|FAIL" $R/selftest-dq64.log) > $R/selftest-diff.txt; echo "dq64: $(grep -E 'checks,' $R/selftest-dq64.log); lines differing from base: $(grep -c '^<' $R/selftest-diff.txt)"
for round in 1 2; do
  order="base dq64"; [ $round = 2 ] && order="dq64 base"
  for v in $order; do
    for seq in 1024 4096 8192; do
      tag=$v-r$round-t$seq
      timeout 200 /tmp/kiln-$v bench kernels --only compute --dtypes bf16,f16 --seq $seq --rows $((4 * seq)) --channels 2048 --heads 16 --no-python --reps 10 --out $R/$tag > $R/$tag.log 2>&1
      echo "$tag rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_backward ' $R/$tag.log | awk '{print $2, $7}' | paste -sd' ')"
    done
  done
  tag=$v-r$round-t4096-c768
  timeout 200 /tmp/kiln-$v bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 --no-python --reps 10 --out $R/$tag > $R/$tag.log 2>&1
  echo "$tag rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_backward ' $R/$tag.log | awk '{print $2, $7}' | paste -sd' ')"
done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
