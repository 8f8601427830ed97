#!/usr/bin/env bash
# Prefill packed by rows: selftest's prefill rows, the prefill's kernels under Nsight Compute
# (SmolLM2-135M, batch 64), then bench generate with the previous build (fuse) and this one
# alternating; then `kiln plan --generate` against real calls.
set -u
for b in fuse prefill; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
timeout 290 /tmp/kiln-prefill selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head; grep -E "^prefill_attention" $OUT/selftest.log | head -3
timeout 100 /usr/local/cuda/bin/ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv -k regex:"prefill_pack|attention_forward|gather_rows|cache_attention_bf16|kv_append_normed" --launch-count 400 /tmp/kiln-prefill bench generate --shape smollm2-135m --batches 64 --new-tokens 4 --no-python --no-cuda-graphs --out /tmp/bgn > $OUT/ncu.csv 2>/dev/null; echo "ncu rc $?"
python3 - $OUT/ncu.csv <<'PY'
import csv, sys, collections, statistics
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
m = collections.defaultdict(list)
for r in csv.DictReader(lines):
    if r["Metric Name"] == "gpu__time_duration.sum":
        m[r["Kernel Name"].split("(")[0]].append(float(r["Metric Value"].replace(",", "")) / 1e3)
for k, v in sorted(m.items()):
    print(f"{k:40s} n={len(v):4d} median {statistics.median(v):7.2f} us  max {max(v):7.2f}")
PY
gzip -f $OUT/ncu.csv
for round in 1 2; do
  for b in fuse prefill; do
    for sh in smollm2-135m llama-3.2-1b; do
      timeout 45 /tmp/kiln-$b bench generate --shape $sh --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$b-$sh > /tmp/$b-$sh-$round.log 2>&1
      echo "$b $sh round $round rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" /tmp/$b-$sh-$round.log
    done
  done
done
KILN=/tmp/kiln-prefill OUT=/tmp/pgc timeout 150 bash bench/plan_generate_gpu_check.sh 2>&1 | tail -12; echo "plan check rc $? t=$(( $(date +%s)-s ))"
