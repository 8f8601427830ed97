#!/usr/bin/env bash
# The decode step's append and attention in one kernel (queries formed once a block in shared
# memory), and wide attention blocks (256 threads) where a call's blocks leave room on the GPU:
# kernel selftest of the new build, then `kiln bench generate --no-python` (random weights,
# 64-token prompts, 128 new tokens, bf16, CUDA graphs): the previous build (pair); the new one
# with two kernels (split); fused; wide blocks up to 2 blocks an SM, narrow appending blocks
# beyond.
set -u
for b in pair fuse; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 260 /tmp/kiln-fuse selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
grep -E "^cache_attention_append" $OUT/selftest.log | sort -k5 -g -t'|' | tail -4
timeout 90 /tmp/kiln-pair selftest --only kernels > /dev/null 2>&1; echo "pair warm t=$(( $(date +%s)-s ))"
run() { # shape name binary env...
  local sh=$1 n=$2 b=$3; shift 3
  env "$@" timeout 100 /tmp/kiln-$b bench generate --shape $sh --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$sh-$n > $OUT/$sh-$n.log 2>&1
  echo "$sh $n rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" $OUT/$sh-$n.log
}
for round in 1 2; do
  run smollm2-135m pair-$round pair X=1
  run smollm2-135m split-$round fuse KILN_SPLIT_DECODE_ATTENTION=1
  run smollm2-135m fuse-$round fuse X=1
done
for round in 1 2; do run llama-3.2-1b pair-$round pair X=1; run llama-3.2-1b split-$round fuse KILN_SPLIT_DECODE_ATTENTION=1; run llama-3.2-1b fuse-$round fuse X=1; done
