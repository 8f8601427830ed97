#!/usr/bin/env bash
# Cross-entropy rows split over thread-block clusters: the kernel selftest (new build), then
# Nsight Compute times of the fused cross-entropy in one training step (GPT-2 small 16 x 1024,
# vocabulary 50304; the Llama-3.2-1B width and vocabulary 128256 with 2 layers, 8 x 1024),
# bf16-mixed, previous build (the folded decode, 00fed1e) and this one; then GPT-2 small
# tokens/s, the builds alternating.
set -u
gunzip -c gpubin/kiln-fold.gz > /tmp/kiln-prev; gunzip -c gpubin/kiln-ce.gz > /tmp/kiln-ce; chmod +x /tmp/kiln-*
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 240 /tmp/kiln-ce selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|FAIL" $OUT/selftest.log | head -20; grep -E "cross_entropy_fused" $OUT/selftest.log | head -40
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
L1B2="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=2 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2 train.micro_batch=8"
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for shape in GPT2 L1B2; do
  for b in prev ce; do
    timeout 150 $NCU --profile-from-start off --cache-control none --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed -k regex:"cross_entropy" --csv \
      /tmp/kiln-$b train --device cuda --out /tmp/nc$shape$b -q --profile none $common ${!shape} train.steps=3 --profile-steps 3..=3 > $OUT/ncu_${shape}_$b.csv 2>/dev/null
    echo "ncu $shape $b rc $? t=$(( $(date +%s)-s ))"
    python3 - "$OUT/ncu_${shape}_$b.csv" "$shape $b" <<'PY'
import csv, sys, collections
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
m = collections.defaultdict(lambda: collections.defaultdict(list))
for r in csv.DictReader(lines):
    m[r["Kernel Name"].split("(")[0]][r["Metric Name"]].append(float(r["Metric Value"].replace(",", "")))
for k, v in m.items():
    t = v["gpu__time_duration.sum"]
    print(sys.argv[2], k, len(t), "launches,", [round(x / 1e3, 1) for x in t], "us; dram %", [round(x, 1) for x in v["dram__throughput.avg.pct_of_peak_sustained_elapsed"]])
PY
  done
done
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print('$2 median tokens/s', round(statistics.median(x['tokens_per_s'] for x in t)), 'steps', len(t), 'last loss', r[-1].get('loss'))"; }
for round in 1 2; do
  for b in prev ce; do
    timeout 100 /tmp/kiln-$b train --device cuda --out /tmp/g$b$round -q --profile none $common $GPT2 train.steps=30 > /dev/null 2>&1; echo "gpt2 $b rc $? t=$(( $(date +%s)-s ))"; med /tmp/g$b$round "gpt2 $b $round"
  done
done
gzip -f $OUT/*.csv
