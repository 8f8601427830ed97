#!/usr/bin/env bash
# Prefill through the training attention: kernel selftest of the new build, then
# `kiln bench generate --no-python` with the previous build (fuse) and this one (prefill)
# alternating, on the SmolLM2-135M and Llama-3.2-1B shapes.
set -u
for b in fuse prefill; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
s=$(date +%s)
timeout 290 /tmp/kiln-prefill selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
grep -E "^prefill_attention" $OUT/selftest.log
for round in 1 2; do
  for b in fuse prefill; do
    for sh in smollm2-135m llama-3.2-1b; do
      timeout 45 /tmp/kiln-$b bench generate --shape $sh --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$b-$sh > $OUT/$b-$sh-$round.log 2>&1
      echo "$b $sh round $round rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" $OUT/$b-$sh-$round.log
    done
  done
done
