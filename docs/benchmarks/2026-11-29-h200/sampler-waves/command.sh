#!/usr/bin/env bash
# The sampler's blocks per row from the stages' occupancy (whole waves): kernel selftest of the
# new build (sampler), the sampler stages under Nsight Compute at batch 64 for both builds, then
# `kiln bench generate --no-python` with the previous build (prefill) and this one alternating.
set -u
for b in prefill sampler; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
timeout 290 /tmp/kiln-sampler selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head; grep -E "^sample_rows" $OUT/selftest.log | sort -t'|' -k4 -g | tail -3
for b in prefill sampler; do
  timeout 80 /usr/local/cuda/bin/ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv -k regex:"sample_" --launch-skip 40 --launch-count 80 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 64 --new-tokens 40 --no-python --no-cuda-graphs --out /tmp/bgn > $OUT/ncu-$b.csv 2>/dev/null; echo "ncu $b rc $?"
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
for round in 1 2; do
  for b in prefill sampler; do
    for sh in smollm2-135m llama-3.2-1b; do
      timeout 45 /tmp/kiln-$b bench generate --shape $sh --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$b-$sh > /tmp/$b-$sh-$round.log 2>&1
      echo "$b $sh round $round rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" /tmp/$b-$sh-$round.log
    done
  done
done
