#!/usr/bin/env bash
# The mask split in the tf32 and mma.sync kernels too: selftest, f32/tf32 attention old/new.
set -u
for b in old att2; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 200 /tmp/kiln-att2 selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head
for b in old att2 old att2; do
  timeout 100 /tmp/kiln-$b bench kernels --only compute --rows 8192 --seq 1024 --dtypes f32 --vocab 1024 --out $OUT/k-$b > $OUT/kernels-f32-$b.log 2>&1
  echo "== $b f32/tf32 head size 64, T 1024 (rc $?, t=$(( $(date +%s)-s )))"; grep -E "^attention.*x$" $OUT/kernels-f32-$b.log
done
rm -rf $OUT/k-*
