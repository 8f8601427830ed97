#!/usr/bin/env bash
# Tensor::cuda_mut without formatting its panic message on every call (new) against 3bae146
# (base), alternating twice: LoRA at the SmolLM2-135M shape (16 x 1024), GPT-2 small full
# training (bf16-mixed, 8 x 1024), and the default job (a 0.84M-parameter GPT, 16 x 128,
# whose GPU steps are bound by the host), median tokens/s of each run; then a trace of the new
# build's LoRA step for its optimizer phase.
set -u
xz -dc gpubin/kiln-base.xz > /tmp/kiln-base; xz -dc gpubin/kiln-new.xz > /tmp/kiln-new; chmod +x /tmp/kiln-*
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5"
S135="model.kind=llama model.vocab=49152 model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.head_dim=64 model.ffn_hidden=1536 model.context=1024 model.rope_theta=100000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpubin/tok/tokenizer.json train.micro_batch=16"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=8"
LORA="lora.rank=16 lora.alpha=32 lora.targets=all-linear"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>$3]
print('$2 median tokens/s', round(statistics.median(x['tokens_per_s'] for x in t)), 'steps', len(t))"; }
gunzip -c data/shakespeare.txt.gz > /tmp/shakespeare.txt; D=/tmp/shakespeare.txt
/tmp/kiln-new train --device cuda --out /tmp/b -q --profile none $common $S135 train.steps=1 > /dev/null 2>&1; echo "base rc $?"
/tmp/kiln-new export --run /tmp/b --to /tmp/bx > /dev/null 2>&1; echo "export rc $? t=$(( $(date +%s)-s ))"
for round in ${ROUNDS:-1 2}; do
  for b in new base; do
    timeout 100 /tmp/kiln-$b finetune --device cuda --init-from /tmp/bx --data $D --out /tmp/l-$b-$round -q --profile none $common $LORA train.micro_batch=16 train.steps=24 train.save_final=false > /dev/null 2>&1; echo "lora $b $round rc $?"; med /tmp/l-$b-$round "lora-s135 $b round $round" 5
    [ -n "${LORA_ONLY:-}" ] && continue
    timeout 100 /tmp/kiln-$b train --device cuda --out /tmp/g-$b-$round -q --profile none $common $GPT2 train.steps=30 train.save_final=false > /dev/null 2>&1; echo "gpt2 $b $round rc $?"; med /tmp/g-$b-$round "gpt2-8 $b round $round" 10
    [ -n "${LORA_ONLY:-}" ] && continue
    timeout 100 /tmp/kiln-$b train --device cuda --out /tmp/t-$b-$round -q --profile none train.steps=300 train.log_every=10 train.eval_every=0 train.checkpoint_every=0 train.save_final=false > /dev/null 2>&1; echo "tiny $b $round rc $? t=$(( $(date +%s)-s ))"; med /tmp/t-$b-$round "default job $b round $round" 50
  done
done
timeout 100 /tmp/kiln-new finetune --device cuda --init-from /tmp/bx --data $D --out /tmp/lt -q --profile none $common $LORA train.micro_batch=16 train.steps=14 train.save_final=false --trace $OUT/lora-s135.json --trace-steps 12..=13 > /dev/null 2>&1; echo "trace rc $?"
python3 - $OUT/lora-s135.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1])); ev=d["traceEvents"] if isinstance(d,dict) else d
ph=[e for e in ev if e.get("tid")==1 and e.get("ph")=="X"]; ops=sorted([e for e in ev if e.get("tid")==2 and e.get("ph")=="X"],key=lambda e:e["ts"])
for p in ph:
    if p['name'].startswith('optim'):
        print('optimizer phase', round(p['dur'],1), 'us:', [(e['name'], round(e['ts']-p['ts'],1), round(e['dur'],1)) for e in ops if p['ts']<=e['ts']<p['ts']+p['dur']])
PY
gzip -f $OUT/*.json
