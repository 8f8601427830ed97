#!/usr/bin/env bash
set -u
gunzip -c gpubin/kiln-pair.gz > /tmp/kiln-pair; chmod +x /tmp/kiln-pair
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout 200 $NCU --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv -k regex:"sample_|kv_append|cache_attention|swiglu_forward_normed|gather_slot" --launch-skip 300 --launch-count 400 /tmp/kiln-pair bench generate --shape smollm2-135m --batches 64 --new-tokens 24 --no-python --no-cuda-graphs --out /tmp/bgd > $OUT/decode_ncu.csv 2>/dev/null; echo "ncu rc $?"
python3 - $OUT/decode_ncu.csv <<'PY'
import csv, sys, collections, statistics
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
m = collections.defaultdict(list)
for r in csv.DictReader(lines):
    if r["Metric Name"] == "gpu__time_duration.sum":
        m[r["Kernel Name"].split("(")[0]].append(float(r["Metric Value"].replace(",", "")) / 1e3)
for k, v in sorted(m.items()):
    print(f"{k:40s} n={len(v):4d} median {statistics.median(v):7.2f} us  min {min(v):7.2f}")
PY
gzip -f $OUT/decode_ncu.csv
