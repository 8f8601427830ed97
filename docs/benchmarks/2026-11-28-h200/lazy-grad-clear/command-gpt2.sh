#!/usr/bin/env bash
# Gradient clears left to each gradient's first writer (the weight-gradient product overwrites,
# beta = 0), frozen RMSNorm gains without gain gradients: kernel selftest of the new build, then
# GPT-2 small bf16-mixed 16 x 1024, previous build (review) and this one alternating twice.
set -u
for b in review lazy; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 240 /tmp/kiln-lazy selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
grep -E "^(linear_backward|rmsnorm_backward)" $OUT/selftest.log | head -20
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print('$2 median tokens/s', round(statistics.median(x['tokens_per_s'] for x in t)), 'steps', len(t), 'loss@30', r[-1].get('loss'))"; }
for round in 1 2; do
  for b in review lazy; do
    timeout 100 /tmp/kiln-$b train --device cuda --out /tmp/g$b$round -q --profile none $common $GPT2 train.steps=30 > $OUT/gpt2-$b-$round.log 2>&1; echo "gpt2 $b rc $? t=$(( $(date +%s)-s ))"; med /tmp/g$b$round "gpt2 $b $round"
  done
done
