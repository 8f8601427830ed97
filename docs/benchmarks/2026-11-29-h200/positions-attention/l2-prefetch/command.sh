#!/usr/bin/env bash
# The cache attention's L2 prefetch of the cached range its copies leave out (pref) against
# 446c5e2 (head): kernel caches filled, `kiln bench generate --no-python` alternating, two
# rounds; then head beside transformers (`kiln bench generate`, Python side on); then every
# kernel of a SmolLM2-135M batch-64 decode step of head under Nsight Compute.
set -u
R=$OUT
for b in head pref; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,8,16,32,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh head=/tmp/kiln-head pref=/tmp/kiln-pref > $R/ab.txt 2>&1
tail -6 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5
for sh in smollm2-135m:1,8,16,32,64,256 llama-3.2-1b:1,8,64; do
  name=${sh%%:*}; b=${sh##*:}
  timeout 170 /tmp/kiln-head bench generate --shape $name --batches $b --new-tokens 128 --out /tmp/bg-$name > /tmp/$name.log 2>&1
  echo "$name rc $? t=$(( $(date +%s)-s ))"; grep -E "^(kiln|transformers) batch" /tmp/$name.log
  mkdir -p $R/$name; cp /tmp/bg-$name/report.md /tmp/bg-$name/results.json $R/$name/ 2>/dev/null
done
timeout 100 /usr/local/cuda/bin/ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 900 --launch-count 480 /tmp/kiln-head bench generate --shape smollm2-135m --batches 64 --new-tokens 24 --no-python --no-cuda-graphs --out /tmp/bgd > /tmp/ncu_head.csv 2>/dev/null; echo "ncu rc $? t=$(( $(date +%s)-s ))"
python3 docs/benchmarks/2026-11-29-h200/few-rows-products/ncu/decode_steps.py /tmp/ncu_head.csv > $R/decode_step.txt; head -14 $R/decode_step.txt
gzip -c /tmp/ncu_head.csv > $R/ncu_head.csv.gz
