#!/usr/bin/env bash
# Wide cache-attention blocks of three query heads (SmolLM2's three a key/value head) instead
# of four with one repeated: kernel selftest of the new build (g3); the appending attention of a
# batch-64 SmolLM2 decode under Nsight Compute, previous build (base, fd3dc95) and new; then
# `kiln bench generate --no-python` with the two alternating three times.
set -u
for b in base g3; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
timeout 330 /tmp/kiln-g3 selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head -20
grep -E "^cache_attention" $OUT/selftest.log | grep -E "H9/3" | head -40
for b in base g3; do
  timeout 60 /usr/local/cuda/bin/ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv -k regex:"cache_attention" --launch-skip 60 --launch-count 90 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 64 --new-tokens 8 --no-python --no-cuda-graphs --out /tmp/bgn > $OUT/ncu-$b.csv 2>/dev/null; echo "ncu $b rc $?"
  python3 - $OUT/ncu-$b.csv <<'PY'
import csv, sys, collections, statistics
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
m = collections.defaultdict(list)
for r in csv.DictReader(lines):
    if r["Metric Name"] == "gpu__time_duration.sum":
        m[r["Kernel Name"].split("(")[0]].append(float(r["Metric Value"].replace(",", "")) / 1e3)
for k, v in sorted(m.items()):
    print(f"{k:40s} n={len(v):4d} median {statistics.median(v):7.2f} us")
PY
  gzip -f $OUT/ncu-$b.csv
done
for round in 1 2 3; do
  for b in base g3; do
    timeout 30 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$b > /tmp/$b-$round.log 2>&1
    echo "$b round $round rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" /tmp/$b-$round.log
  done
done
