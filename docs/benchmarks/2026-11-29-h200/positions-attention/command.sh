#!/usr/bin/env bash
# The appending decode attention a position a thread, first form (pos1: a separate step for
# each round's maxima and weights, keys copied unswizzled) and second form (pos2: maxima from
# each warp, weights formed by the value threads, keys swizzled), against the kernel of a
# group of lanes per cached vector (lanes: pos2's binary with KILN_DECODE_ATTENTION=lanes):
# kernel caches filled, then `kiln bench generate --no-python` alternating, two rounds.
set -u
R=$OUT
for b in pos1 pos2; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
printf '#!/bin/sh\nKILN_DECODE_ATTENTION=lanes exec /tmp/kiln-pos2 "$@"\n' > /tmp/kiln-lanes && chmod +x /tmp/kiln-lanes
OUT=/tmp/ab SHAPES=smollm2-135m,llama-3.2-1b BATCHES=1,8,16,32,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh lanes=/tmp/kiln-lanes pos1=/tmp/kiln-pos1 pos2=/tmp/kiln-pos2 > $R/ab.txt 2>&1
tail -11 $R/ab.txt
grep -ihE "error|panic" /tmp/ab/*.log | head -5
timeout 120 /usr/local/cuda/bin/ncu --cache-control none --clock-control none -k regex:cache_attention_append --launch-skip 200 --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats /tmp/kiln-pos2 bench generate --shape smollm2-135m --batches 64 --new-tokens 16 --no-python --no-cuda-graphs --out /tmp/ncu-pos2 > $R/ncu-pos2.txt 2>&1
grep -E "^  [a-z_]+.*\(|Duration|SM Active|Registers Per|Warp Cycles Per Issued|Issued Warp Per" $R/ncu-pos2.txt | head -14
