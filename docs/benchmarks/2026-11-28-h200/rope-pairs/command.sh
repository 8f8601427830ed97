#!/usr/bin/env bash
# Rotary embedding kernels split over head parts, with partners by warp shuffle, and the RMSNorm
# backward at one row a block for wide rows (new) against
# the previous build (prev): the kernel selftest, Nsight Compute times of every rope kernel of
# one step (Llama-3.2-1B's layer shape with 2 layers, 8 x 1024; SmolLM2-135M, 16 x 1024), and
# SmolLM2-135M full training tokens/s with the builds alternating. bf16-mixed.
set -u
for b in prev new; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 240 /tmp/kiln-new selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks,|FAIL" $OUT/selftest.log | head; grep -E "rope" $OUT/selftest.log | head -30
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
L1B2="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=2 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2 train.micro_batch=8"
S135="model.kind=llama model.vocab=49152 model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.head_dim=64 model.ffn_hidden=1536 model.context=1024 model.rope_theta=100000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=byte train.micro_batch=16"
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for shape in L1B2 S135; do for b in prev new; do
  timeout 100 $NCU --profile-from-start off --cache-control none --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active -k regex:"rope|rmsnorm_backward_fused" --csv \
    /tmp/kiln-$b train --device cuda --out /tmp/nc$shape$b -q --profile none $common ${!shape} train.steps=3 --profile-steps 3..=3 > $OUT/ncu_${shape}_$b.csv 2>/dev/null
  python3 - "$OUT/ncu_${shape}_$b.csv" "$shape $b" <<'PY'
import csv, sys, collections, statistics
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
m = collections.defaultdict(lambda: collections.defaultdict(list))
for r in csv.DictReader(lines):
    m[r["Kernel Name"].split("(")[0]][r["Metric Name"]].append(float(r["Metric Value"].replace(",", "")))
for k, v in m.items():
    t = v["gpu__time_duration.sum"]
    print(sys.argv[2], k, len(t), "launches, median", round(statistics.median(t) / 1e3, 2), "us, sum", round(sum(t) / 1e3, 1), "us; dram %", round(statistics.median(v["dram__throughput.avg.pct_of_peak_sustained_elapsed"]), 1), "warps active %", round(statistics.median(v["sm__warps_active.avg.pct_of_peak_sustained_active"]), 1))
PY
done; done
echo "t=$(( $(date +%s)-s ))"
for i in 1 2; do for b in prev new; do
  timeout 60 /tmp/kiln-$b train --device cuda --out /tmp/e$b$i -q --profile none $common $S135 train.steps=30 > /dev/null 2>&1
  python3 -c "
import json,statistics; r=[json.loads(l) for l in open('/tmp/e$b$i/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print('smollm2-135m full $b', round(statistics.median(x['tokens_per_s'] for x in t)), 'loss', round(t[-1]['loss'],5))"
done; done
echo "t=$(( $(date +%s)-s ))"
L1B="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2 train.micro_batch=8"
t0=$(date +%s.%N)
timeout 120 /tmp/kiln-new train --device cuda --out /tmp/l1b -q --profile none $common $L1B train.steps=20 > /dev/null 2>&1; echo "l1b new rc $?"
python3 -c "
import json,statistics,os; r=[json.loads(l) for l in open('/tmp/l1b/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>5]
print('llama-1b full new', round(statistics.median(x['tokens_per_s'] for x in t)), 'tokens/s; the whole command', round(float('$(date +%s.%N)') - $t0, 1), 's for 20 steps')"
gzip -f $OUT/*.csv
