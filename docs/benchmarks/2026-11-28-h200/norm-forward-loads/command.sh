#!/usr/bin/env bash
# The residual norm forwards with every group's loads issued before any sum is stored: the
# kernel selftest, then Nsight Compute times of those kernels in one step (GPT-2 small
# 16 x 1024; Llama-3.2-1B's layer shape with 2 layers, 8 x 1024), bf16-mixed.
set -u
gunzip -c gpubin/kiln-new.gz > /tmp/kiln-new; chmod +x /tmp/kiln-new
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 200 /tmp/kiln-new selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks,|FAIL" $OUT/selftest.log | head; grep -E "layernorm_forward|rmsnorm_forward" $OUT/selftest.log | head -40
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
L1B2="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=2 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2 train.micro_batch=8"
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for shape in GPT2 L1B2; do
  timeout 60 $NCU --profile-from-start off --cache-control none --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed -k regex:"layernorm_forward|rmsnorm_forward" --csv \
    /tmp/kiln-new train --device cuda --out /tmp/nc$shape -q --profile none $common ${!shape} train.steps=3 --profile-steps 3..=3 > $OUT/ncu_$shape.csv 2>/dev/null
  python3 - "$OUT/ncu_$shape.csv" "$shape" <<'PY'
import csv, sys, collections, statistics
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
m = collections.defaultdict(lambda: collections.defaultdict(list))
for r in csv.DictReader(lines):
    m[r["Kernel Name"].split("(")[0]][r["Metric Name"]].append(float(r["Metric Value"].replace(",", "")))
for k, v in m.items():
    t = v["gpu__time_duration.sum"]
    print(sys.argv[2], k, len(t), "launches, first", round(t[0] / 1e3, 2), "us, median", round(statistics.median(t) / 1e3, 2), "us, sum", round(sum(t) / 1e3, 1), "us; dram % first", round(v["dram__throughput.avg.pct_of_peak_sustained_elapsed"][0], 1))
PY
done
echo "t=$(( $(date +%s)-s ))"
gzip -f $OUT/*.csv
