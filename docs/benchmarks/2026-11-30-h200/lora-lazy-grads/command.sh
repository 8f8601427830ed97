#!/usr/bin/env bash
# LoRA adapters' gradients cleared by their first write (new) against a clear launched per
# adapter before every step (base): LoRA rank 16 on all linear layers at the Llama-3.2-1B
# shape (8 x 1024) and the SmolLM2-135M shape (16 x 1024), bf16-mixed, the two builds
# alternating twice; every logged loss and gradient norm compared; a trace of the new build
# split by bench/trace_gaps.py; the new copy op in the selftest.
set -u
xz -dc gpubin/kiln-base.xz > /tmp/kiln-base; xz -dc gpubin/kiln-new.xz > /tmp/kiln-new; chmod +x /tmp/kiln-*
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
/tmp/kiln-new selftest --only kernels --match copy_into_at 2>&1 | tail -4
echo "selftest t=$(( $(date +%s)-s ))"
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5"
L1B="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2"
S135="model.kind=llama model.vocab=49152 model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.head_dim=64 model.ffn_hidden=1536 model.context=1024 model.rope_theta=100000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpubin/tok/tokenizer.json"
LORA="lora.rank=16 lora.alpha=32 lora.targets=all-linear"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>$3]
m=statistics.median(x['tokens_per_s'] for x in t)
print('$2 median tokens/s', round(m), 'steps', len(t), 'ms/step', round($4*1e3/m, 2))"; }
same() { python3 -c "
import json; f=lambda d:[(x['step'],x['loss'],x['grad_norm']) for x in map(json.loads,open(d+'/metrics.jsonl')) if x.get('kind')=='train']
a,b=f('$1'),f('$2'); print('$3 steps', len(a), 'losses and gradient norms identical:', a==b)"; }
gunzip -c data/shakespeare.txt.gz > /tmp/shakespeare.txt; D=/tmp/shakespeare.txt
for shape in l1b s135; do
  if [ $shape = l1b ]; then M="$L1B train.micro_batch=8"; tok=8192; else M="$S135 train.micro_batch=16"; tok=16384; fi
  timeout 120 /tmp/kiln-new train --device cuda --out /tmp/base-$shape -q --profile none $common $M train.steps=1 train.save_final=true > /dev/null 2>&1; echo "$shape base rc $?"
  timeout 120 /tmp/kiln-new export --run /tmp/base-$shape --to /tmp/basex-$shape > /dev/null 2>&1; echo "$shape export rc $? t=$(( $(date +%s)-s ))"
  for round in 1 2; do
    for b in new base; do
      o=/tmp/lora-$shape-$b-$round
      timeout 150 /tmp/kiln-$b finetune --device cuda --init-from /tmp/basex-$shape --data $D --out $o -q --profile none $common $LORA train.micro_batch=${M##*=} train.steps=24 train.save_final=false > $OUT/lora-$shape-$b-$round.log 2>&1; echo "$shape $b round $round rc $? t=$(( $(date +%s)-s ))"; med $o "$shape $b round $round" 5 $tok
    done
  done
  same /tmp/lora-$shape-new-1 /tmp/lora-$shape-base-1 $shape
  timeout 150 /tmp/kiln-new finetune --device cuda --init-from /tmp/basex-$shape --data $D --out /tmp/lorat-$shape -q --profile none $common $LORA train.micro_batch=${M##*=} train.steps=14 train.save_final=false --trace $OUT/lora-$shape.json --trace-steps 12..=13 > /dev/null 2>&1; echo "$shape trace rc $? t=$(( $(date +%s)-s ))"
  python3 bench/trace_gaps.py $OUT/lora-$shape.json | grep -v 'host-bound gaps before'
done
gzip -f $OUT/*.json
