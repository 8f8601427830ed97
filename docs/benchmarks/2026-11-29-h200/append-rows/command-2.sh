#!/usr/bin/env bash
# fp32 greedy against transformers with prompts long enough for the packed prefill (new build);
# the append, SwiGLU and cache-attention kernels of a batch-64 SmolLM2 prefill and decode under
# Nsight Compute, previous build (prefill) and new (append); the new build beside transformers
# generate in one command.
set -u
for b in prefill append; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
for m in smollm2-135m llama-3.2-1b; do
  PYTHONUNBUFFERED=1 timeout 150 python3 bench/llama_parity.py --kiln /tmp/kiln-append --tokenizer gpubin/tok --work /tmp/pl-$m --only $m --long-prompts 2>&1 | grep -E "^\||rror|Trace" | tee $OUT/parity-$m-long.txt
  echo "parity $m t=$(( $(date +%s)-s ))"
done
for b in prefill append; do
  timeout 90 /usr/local/cuda/bin/ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv -k regex:"kv_append|swiglu_forward|cache_attention" --launch-count 180 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 64 --new-tokens 8 --no-python --no-cuda-graphs --out /tmp/bgn > $OUT/ncu-$b.csv 2>/dev/null; echo "ncu $b rc $? t=$(( $(date +%s)-s ))"
  python3 - $OUT/ncu-$b.csv <<'PY'
import csv, sys, collections, statistics
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = []
for r in csv.DictReader(lines):
    if r["Metric Name"] == "gpu__time_duration.sum":
        rows.append((int(r["ID"]), r["Kernel Name"].split("(")[0], float(r["Metric Value"].replace(",", "")) / 1e3))
rows.sort()
for phase, part in (("prefill", rows[:60]), ("decode", rows[60:])):
    m = collections.defaultdict(list)
    for _, k, us in part: m[k].append(us)
    for k, v in sorted(m.items()):
        print(f"{phase:8s} {k:40s} n={len(v):4d} median {statistics.median(v):7.2f} us")
PY
  gzip -f $OUT/ncu-$b.csv
done
timeout 200 /tmp/kiln-append bench generate --shape smollm2-135m --batches 1,8,64,256 --new-tokens 128 --out $OUT/bg-hf > $OUT/bench-hf.log 2>&1; echo "bench hf rc $? t=$(( $(date +%s)-s ))"
grep -E "^(kiln|transformers) batch" $OUT/bench-hf.log
