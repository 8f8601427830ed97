#!/usr/bin/env bash
# Every kernel of one SmolLM2-135M decode step under Nsight Compute (stop-50 build), batches 64 and 1;
# then the replayed-graph step rate for the same batches.
set -u
gunzip -c gpubin/kiln-fuse.gz > /tmp/kiln; chmod +x /tmp/kiln
NCU=/usr/local/cuda/bin/ncu
for b in 64 1; do
  timeout 150 $NCU --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 900 --launch-count 480 /tmp/kiln bench generate --shape smollm2-135m --batches $b --new-tokens 24 --no-python --no-cuda-graphs --out /tmp/bgd$b > $OUT/ncu_b$b.csv 2>/dev/null; echo "ncu b$b rc $?"
  python3 docs/benchmarks/2026-11-29-h200/prefill-attention/before/decode_steps.py $OUT/ncu_b$b.csv
  gzip -f $OUT/ncu_b$b.csv
done
timeout 60 /tmp/kiln bench generate --shape smollm2-135m --batches 1,64 --new-tokens 128 --no-python --out /tmp/bg > $OUT/bench.log 2>&1; grep -E "^kiln batch" $OUT/bench.log
