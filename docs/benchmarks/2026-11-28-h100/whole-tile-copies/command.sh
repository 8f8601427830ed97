#!/usr/bin/env bash
# Forward: the running maximum moved only past a slack (lazy O rescale) and tile copies
# without the row test on whole tiles. selftest on `lazy` (both changes), kernels f16s
# (before) / copy (copies only) / lazy (both), GPT-2 A/B f16s vs lazy.
set -u
for b in f16s copy lazy; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
s=$(date +%s)
timeout 220 /tmp/kiln-lazy selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
for cfg in "64 1024" "64 4096" "128 4096"; do
  set -- $cfg; hs=$1; T=$2
  a=""; [ $hs = 128 ] && a="--channels 2048 --heads 16"
  rows=$(( T * 8 )); [ $T = 4096 ] && rows=16384
  for b in f16s copy lazy; do
    timeout 100 /tmp/kiln-$b bench kernels --only compute --rows $rows --seq $T --dtypes bf16,f16 --vocab 1024 $a --out $OUT/k-$b > $OUT/kernels-$b-hs$hs-T$T.log 2>&1
    echo "== $b head size $hs, T $T (rc $?, t=$(( $(date +%s)-s )))"; grep -E "^attention.*x$" $OUT/kernels-$b-hs$hs-T$T.log
  done
done
rm -rf $OUT/k-*
OUT=$OUT/ab ROUNDS=2 timeout 200 bash bench/ab_train_speed.sh /tmp/kiln-f16s /tmp/kiln-lazy 2>&1 | tail -6
rm -rf $OUT/ab/*/
echo "t=$(( $(date +%s)-s ))"
