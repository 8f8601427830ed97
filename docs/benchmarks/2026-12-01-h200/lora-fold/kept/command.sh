#!/usr/bin/env bash
# The kept rule (adapters folded where the widened input stays within the next power of two:
# the SmolLM2-135M shape's layers, not the Llama-3.2-1B shape's): `kiln bench finetune` at the
# SmolLM2-135M shape beside transformers + PEFT, then the fold against the adapters apart
# (KILN_LORA_FOLD=0) there, one binary both ways, twice.
set -u
xz -dc gpubin/kiln-new.xz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
s=$(date +%s)
timeout 330 /tmp/kiln bench finetune --shape smollm2-135m --device cuda --out $OUT/smollm2-135m > $OUT/smollm2-135m.log 2>&1; echo "bench rc $? t=$(( $(date +%s)-s ))"
grep -A8 "^| engine" $OUT/smollm2-135m/report.md | head -9
rm -f $OUT/*/*.png
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5"
S135="model.kind=llama model.vocab=49152 model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.head_dim=64 model.ffn_hidden=1536 model.context=1024 model.rope_theta=100000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpubin/tok/tokenizer.json"
LORA="lora.rank=16 lora.alpha=32 lora.targets=all-linear"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>$3]
m=statistics.median(x['tokens_per_s'] for x in t)
l=[x['loss'] for x in r if x.get('kind')=='train']
print('$2 median tokens/s', round(m), 'ms/step', round($4*1e3/m, 2), 'losses', [round(v, 4) for v in l[:3]], '...', round(l[-1], 4), 'peak', t[-1].get('mem_peak'))"; }
gunzip -c data/shakespeare.txt.gz > /tmp/shakespeare.txt; D=/tmp/shakespeare.txt
timeout 120 /tmp/kiln train --device cuda --out /tmp/base -q --profile none $common $S135 train.micro_batch=16 train.steps=1 train.save_final=true > /dev/null 2>&1; echo "base rc $?"
timeout 120 /tmp/kiln export --run /tmp/base --to /tmp/basex > /dev/null 2>&1; echo "export rc $? t=$(( $(date +%s)-s ))"
for round in 1 2; do
  for f in 1 0; do
    o=/tmp/lora-$f-$round
    KILN_LORA_FOLD=$f timeout 150 /tmp/kiln finetune --device cuda --init-from /tmp/basex --data $D --out $o -q --profile none $common $LORA train.micro_batch=16 train.steps=24 train.save_final=false > /dev/null 2>&1; echo "fold=$f round $round rc $? t=$(( $(date +%s)-s ))"; med $o "s135 fold=$f round $round" 5 16384
  done
done
