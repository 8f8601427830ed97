#!/usr/bin/env bash
# Llama-3.2-1B shape, 8 x 1024, bf16-mixed: wall tokens/s and every kernel of step 3 under
# Nsight Compute, for full training and for LoRA rank 16 on all linear layers.
set -u
gunzip -c gpubin/kiln-new.gz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.micro_batch=8"
L1B="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2"
LORA="lora.rank=16 lora.alpha=32 lora.targets=all-linear"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>5]
print('$2 median tokens/s', round(statistics.median(x['tokens_per_s'] for x in t)), 'ms/step', round(8192e3/statistics.median(x['tokens_per_s'] for x in t),2))"; }
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 120 /tmp/kiln train --device cuda --out /tmp/full -q --profile none $common $L1B train.steps=20 train.save_final=false > $OUT/full.log 2>&1; echo "full rc $? t=$(( $(date +%s)-s ))"; med /tmp/full full
timeout 200 $NCU --profile-from-start off --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv \
  /tmp/kiln train --device cuda --out /tmp/ncf -q --profile none $common $L1B train.steps=4 train.save_final=false --profile-steps 3..=3 > $OUT/full_ncu.csv 2>/dev/null; echo "ncu full rc $? t=$(( $(date +%s)-s ))"
python3 docs/benchmarks/2026-11-28-h200/gpt2-step-split/ncu_steps.py $OUT/full_ncu.csv -1 | tee $OUT/full_step.txt | head -45
timeout 120 /tmp/kiln train --device cuda --out /tmp/base -q --profile none $common $L1B train.steps=1 train.save_final=true > /dev/null 2>&1; echo "base rc $?"
timeout 120 /tmp/kiln export --run /tmp/base --to /tmp/basex > /dev/null 2>&1; echo "export rc $? t=$(( $(date +%s)-s ))"
gunzip -c data/shakespeare.txt.gz > /tmp/shakespeare.txt; D=/tmp/shakespeare.txt
timeout 150 /tmp/kiln finetune --device cuda --init-from /tmp/basex --data $D --out /tmp/lora -q --profile none $common $LORA train.steps=20 train.save_final=false > $OUT/lora.log 2>&1; echo "lora rc $? t=$(( $(date +%s)-s ))"; med /tmp/lora lora
timeout 200 $NCU --profile-from-start off --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv \
  /tmp/kiln finetune --device cuda --init-from /tmp/basex --data $D --out /tmp/ncl -q --profile none $common $LORA train.steps=4 train.save_final=false --profile-steps 3..=3 > $OUT/lora_ncu.csv 2>/dev/null; echo "ncu lora rc $? t=$(( $(date +%s)-s ))"
python3 docs/benchmarks/2026-11-28-h200/gpt2-step-split/ncu_steps.py $OUT/lora_ncu.csv -1 | tee $OUT/lora_step.txt | head -60
gzip -f $OUT/*.csv
