#!/usr/bin/env bash
# Hopper attention without the mask's selects on unmasked tiles and with one multiply a tile
# in the tile copies: selftest, kernels old/new, GPT-2 A/B (losses must be identical).
set -u
for b in old att; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 200 /tmp/kiln-att selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head; grep -iE "attention.*(repeat|bf16|f16)" $OUT/selftest.log | wc -l
for hs in 64 128; do
  a=""; [ $hs = 128 ] && a="--channels 2048 --heads 16"
  for T in 1024 4096; do
    rows=$(( T * 8 )); [ $T = 4096 ] && rows=16384
    for b in old att; do
      timeout 140 /tmp/kiln-$b bench kernels --only compute --rows $rows --seq $T --dtypes bf16,f16 --vocab 1024 $a --out $OUT/k-$b-$hs-$T > $OUT/kernels-$b-hs$hs-T$T.log 2>&1
      echo "== $b head size $hs, T $T (rc $?, t=$(( $(date +%s)-s )))"; grep -E "^attention.*x$" $OUT/kernels-$b-hs$hs-T$T.log
    done
  done
done
rm -rf $OUT/k-*
OUT=$OUT/ab ROUNDS=2 timeout 300 bash bench/ab_train_speed.sh /tmp/kiln-old /tmp/kiln-att 2>&1 | tail -8
echo "t=$(( $(date +%s)-s ))"
