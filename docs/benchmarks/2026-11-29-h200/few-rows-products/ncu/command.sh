#!/usr/bin/env bash
# Few-row products, rows split over blocks of 8 or 16 (rows2): `kiln bench generate --no-python`
# at batches 1-64 with the previous build (base, b1379b1) and this one alternating; then every
# kernel of a batch-64 SmolLM2-135M decode step of each under Nsight Compute.
set -u
for b in base rows; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
for round in 1 2; do
  for b in base rows; do
    for sh in smollm2-135m llama-3.2-1b; do
      timeout 50 /tmp/kiln-$b bench generate --shape $sh --batches 1,8,16,32,64 --new-tokens 128 --no-python --out /tmp/bg-$b-$sh > /tmp/$b-$sh.log 2>&1
      echo "$b $sh round $round rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" /tmp/$b-$sh.log
    done
  done
done
for b in base rows; do
  timeout 100 /usr/local/cuda/bin/ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 900 --launch-count 480 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 64 --new-tokens 24 --no-python --no-cuda-graphs --out /tmp/bgd > $OUT/ncu_$b.csv 2>/dev/null; echo "ncu $b rc $?"
  python3 gpubin/decode_steps.py $OUT/ncu_$b.csv | head -14
  gzip -f $OUT/ncu_$b.csv
done
