#!/usr/bin/env bash
# The decode step's key/value append and attention in one kernel, and attention blocks of 256
# threads (groups of a warp merged by shuffles): kernel selftest of the new build, then
# `kiln bench generate --no-python` (random weights, 64-token prompts, 128 new tokens, bf16,
# CUDA graphs) with the previous build (pair), the new one with the two kernels
# (KILN_SPLIT_DECODE_ATTENTION=1: 256-thread attention only) and the new one fused, alternating.
set -u
for b in pair fuse; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 260 /tmp/kiln-fuse selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
grep -E "^cache_attention" $OUT/selftest.log | head -60
timeout 90 /tmp/kiln-pair selftest --only kernels > /dev/null 2>&1; echo "pair warm t=$(( $(date +%s)-s ))"
run() { # name binary env...
  local n=$1 b=$2; shift 2
  env "$@" timeout 100 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$n > $OUT/smol-$n.log 2>&1
  echo "smol $n rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" $OUT/smol-$n.log
}
for round in 1 2; do
  run pair-$round pair X=1
  run split-$round fuse KILN_SPLIT_DECODE_ATTENTION=1
  run fuse-$round fuse X=1
done
for b in pair fuse; do
  timeout 100 /tmp/kiln-$b bench generate --shape llama-3.2-1b --batches 1,64 --new-tokens 128 --no-python --out /tmp/bl-$b > $OUT/l1b-$b.log 2>&1
  echo "l1b $b rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" $OUT/l1b-$b.log
done
