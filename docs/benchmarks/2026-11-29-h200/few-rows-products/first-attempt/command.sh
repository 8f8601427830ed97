#!/usr/bin/env bash
# Few-row products on tensor cores for the decode step (QKV, output, down; gate/up fused with the
# norm and SwiGLU): kernel selftest of the new build (rows), then `kiln bench generate
# --no-python` with the previous build (base, b1379b1) and the new one alternating.
set -u
for b in base rows; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 330 /tmp/kiln-rows selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head -20
grep -E "^(few_rows|linear_forward)" $OUT/selftest.log | head -40
for b in base rows; do
  for sh in smollm2-135m llama-3.2-1b; do
    timeout 50 /tmp/kiln-$b bench generate --shape $sh --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$b-$sh > /tmp/$b-$sh.log 2>&1
    echo "$b $sh rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" /tmp/$b-$sh.log
  done
done
