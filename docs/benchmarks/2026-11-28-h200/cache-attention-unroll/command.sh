#!/usr/bin/env bash
# The cache attention's groups load four positions' keys and values before using the first:
# kernel selftest of the new build, then `kiln bench generate --no-python` (random weights,
# 64-token prompts, 128 new tokens, bf16, CUDA graphs) with the previous build (pair) and this
# one (unroll) alternating.
set -u
for b in pair unroll; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 240 /tmp/kiln-unroll selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
grep -E "^cache_attention" $OUT/selftest.log | head -30
timeout 60 /tmp/kiln-pair selftest --only kernels > /dev/null 2>&1; echo "pair warm t=$(( $(date +%s)-s ))"
for round in 1 2; do
  for b in pair unroll; do
    timeout 100 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$b-$round > $OUT/smol-$b-$round.log 2>&1
    echo "smol $b round $round rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" $OUT/smol-$b-$round.log
  done
done
for b in pair unroll; do
  timeout 120 /tmp/kiln-$b bench generate --shape llama-3.2-1b --batches 1,64 --new-tokens 128 --no-python --out /tmp/bl-$b > $OUT/l1b-$b.log 2>&1
  echo "l1b $b rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" $OUT/l1b-$b.log
done
