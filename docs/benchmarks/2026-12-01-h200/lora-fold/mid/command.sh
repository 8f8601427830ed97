#!/usr/bin/env bash
# The kept fold rule at a width between the two measured ones: a Qwen2-0.5B-shaped model
# (width 896, 24 layers, 14 heads and 2 key/value heads of 64, feed-forward 4864, vocabulary
# 151936, tied), random weights, LoRA rank 16 on all linear layers, micro-batch 8 x 1024,
# bf16-mixed: folded (896 + 48 and 896 + 32 stay within 1024) against apart
# (KILN_LORA_FOLD=0), one binary both ways, twice.
set -u
xz -dc gpubin/kiln-new.xz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5"
Q05="model.kind=llama model.vocab=151936 model.d_model=896 model.n_layers=24 model.n_heads=14 model.n_kv_heads=2 model.head_dim=64 model.ffn_hidden=4864 model.context=1024 model.rope_theta=1000000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2"
LORA="lora.rank=16 lora.alpha=32 lora.targets=all-linear"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>$3]
m=statistics.median(x['tokens_per_s'] for x in t)
l=[x['loss'] for x in r if x.get('kind')=='train']
print('$2 median tokens/s', round(m), 'ms/step', round($4*1e3/m, 2), 'losses', [round(v, 4) for v in l[:3]], '...', round(l[-1], 4), 'peak', t[-1].get('mem_peak'))"; }
gunzip -c data/shakespeare.txt.gz > /tmp/shakespeare.txt; D=/tmp/shakespeare.txt
timeout 150 /tmp/kiln train --device cuda --out /tmp/base -q --profile none $common $Q05 train.micro_batch=8 train.steps=1 train.save_final=true > /dev/null 2>&1; echo "base rc $?"
timeout 120 /tmp/kiln export --run /tmp/base --to /tmp/basex > /dev/null 2>&1; echo "export rc $? t=$(( $(date +%s)-s ))"
for round in 1 2; do
  for f in 1 0; do
    o=/tmp/lora-$f-$round
    KILN_LORA_FOLD=$f timeout 150 /tmp/kiln finetune --device cuda --init-from /tmp/basex --data $D --out $o -q --profile none $common $LORA train.micro_batch=8 train.steps=24 train.save_final=false > /dev/null 2>&1; echo "fold=$f round $round rc $? t=$(( $(date +%s)-s ))"; med $o "q05 fold=$f round $round" 5 8192
  done
done
