#!/usr/bin/env bash
# Folded norm gains in the Llama decode step: the kernel selftest (new build), then `kiln bench
# generate --no-python` (random weights, 64-token prompts, 128 new tokens, bf16, CUDA graphs)
# with the previous build and this one alternating in one command.
set -u
gunzip -c gpubin/kiln-new.gz > /tmp/kiln-prev; gunzip -c gpubin/kiln-fold.gz > /tmp/kiln-fold; chmod +x /tmp/kiln-*
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 240 /tmp/kiln-fold selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|FAIL" $OUT/selftest.log | head -20
grep -E "_normed" $OUT/selftest.log | head -40
timeout 60 /tmp/kiln-prev selftest --only kernels > /dev/null 2>&1; echo "prev warm t=$(( $(date +%s)-s ))"
for round in 1 2; do
  for b in prev fold; do
    timeout 100 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$b-$round > $OUT/smol-$b-$round.log 2>&1
    echo "smol $b round $round rc $? t=$(( $(date +%s)-s ))"; grep -E "^\|" /tmp/bg-$b-$round/report.md | head -12
  done
done
for b in prev fold; do
  timeout 120 /tmp/kiln-$b bench generate --shape llama-3.2-1b --batches 1,64 --new-tokens 128 --no-python --out /tmp/bl-$b > $OUT/l1b-$b.log 2>&1
  echo "l1b $b rc $? t=$(( $(date +%s)-s ))"; grep -E "^\|" /tmp/bl-$b/report.md | head -12
done
