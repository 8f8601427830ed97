#!/usr/bin/env bash
# The appending decode attention a position a thread (pos, the default) against the kernel of a
# group of lanes per cached vector (lanes: the same binary with KILN_DECODE_ATTENTION=lanes):
# kernel caches filled, then `kiln bench generate --no-python` alternating, two rounds; Nsight
# Compute on both kernels at SmolLM2-135M batch 64.
set -u
R=$OUT
xz -dc gpubin/kiln-pos.xz > /tmp/kiln && chmod +x /tmp/kiln
printf '#!/bin/sh\nKILN_DECODE_ATTENTION=lanes exec /tmp/kiln "$@"\n' > /tmp/kiln-lanes && chmod +x /tmp/kiln-lanes
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m,llama-3.2-1b BATCHES=1,8,16,32,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh lanes=/tmp/kiln-lanes pos=/tmp/kiln > $R/ab.txt 2>&1
cat $R/ab.txt | tail -12
grep -ihE "error|panic" /tmp/ab/*.log | head -5
for v in pos lanes; do
  b=/tmp/kiln; [ $v = lanes ] && b=/tmp/kiln-lanes
  timeout 120 /usr/local/cuda/bin/ncu --cache-control none --clock-control none -k regex:cache_attention_append --launch-skip 200 --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats $b bench generate --shape smollm2-135m --batches 64 --new-tokens 16 --no-python --no-cuda-graphs --out /tmp/ncu-$v > $R/ncu-$v.txt 2>&1
  echo "ncu $v rc $? t=$(( $(date +%s)-s ))"
  grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issued Warp Per" $R/ncu-$v.txt | head -14
done
