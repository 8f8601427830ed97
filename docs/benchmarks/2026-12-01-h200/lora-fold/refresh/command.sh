#!/usr/bin/env bash
# The folded weight's B columns refreshed by a copy kernel (set_block, build `new`) instead of
# a cuBLASLt B @ I product per adapter (build `base`, the fold as first kept): the copy's
# selftest checks, then LoRA rank 16 at the SmolLM2-135M shape (16 x 1024, bf16-mixed), the
# two builds alternating twice.
set -u
for b in base new; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
/tmp/kiln-new selftest --only kernels --match set_block,add_cols 2>&1 | grep -E "set_block|add_cols|checks" | tail -8
echo "selftest t=$(( $(date +%s)-s ))"
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5"
S135="model.kind=llama model.vocab=49152 model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.head_dim=64 model.ffn_hidden=1536 model.context=1024 model.rope_theta=100000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpubin/tok/tokenizer.json"
LORA="lora.rank=16 lora.alpha=32 lora.targets=all-linear"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>$3]
m=statistics.median(x['tokens_per_s'] for x in t)
l=[x['loss'] for x in r if x.get('kind')=='train']
print('$2 median tokens/s', round(m), 'ms/step', round($4*1e3/m, 2), 'losses', [round(v, 4) for v in l[:3]], '...', round(l[-1], 4), 'peak', t[-1].get('mem_peak'))"; }
gunzip -c data/shakespeare.txt.gz > /tmp/shakespeare.txt; D=/tmp/shakespeare.txt
timeout 120 /tmp/kiln-new train --device cuda --out /tmp/base -q --profile none $common $S135 train.micro_batch=16 train.steps=1 train.save_final=true > /dev/null 2>&1; echo "base rc $?"
timeout 120 /tmp/kiln-new export --run /tmp/base --to /tmp/basex > /dev/null 2>&1; echo "export rc $? t=$(( $(date +%s)-s ))"
for round in 1 2; do
  for b in new base; do
    o=/tmp/lora-$b-$round
    timeout 150 /tmp/kiln-$b finetune --device cuda --init-from /tmp/basex --data $D --out $o -q --profile none $common $LORA train.micro_batch=16 train.steps=24 train.save_final=false > /dev/null 2>&1; echo "$b round $round rc $? t=$(( $(date +%s)-s ))"; med $o "s135 $b round $round" 5 16384
  done
done
