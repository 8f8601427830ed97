#!/usr/bin/env bash
# Llama-3.2-1B shape, full training bf16-mixed 8 x 1024: review build and the lazy-clear build
# alternating twice.
set -u
for b in review lazy; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
L1B="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2 train.micro_batch=8"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>8]
print('$2 median tokens/s', round(statistics.median(x['tokens_per_s'] for x in t)), 'steps', len(t))"; }
for round in 1 2; do
  for b in review lazy; do
    timeout 120 /tmp/kiln-$b train --device cuda --out /tmp/l$b$round -q --profile none $common $L1B train.steps=24 > $OUT/l1b-$b-$round.log 2>&1; echo "l1b $b rc $? t=$(( $(date +%s)-s ))"; med /tmp/l$b$round "l1b $b $round"
  done
done
