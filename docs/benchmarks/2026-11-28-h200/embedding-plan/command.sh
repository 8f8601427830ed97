#!/usr/bin/env bash
# Where a training step's GPU idles (nsys): GPT-2 small bf16-mixed 8 x 1024 and 16 x 1024, the SmolLM2-135M shape 16 x 1024.
set -u
gunzip -c gpubin/kiln-cur.gz > /tmp/kiln; chmod +x /tmp/kiln
NSYS=$(ls /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1); [ -x "$NSYS" ] || NSYS=$(which nsys); $NSYS --version
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=5 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2"
W=/tmp/w; mkdir -p $W
python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[1][1], '$W/smol', 'gpubin/tok')" > $OUT/save.log 2>&1 || echo "save failed"
for run in "g8|$GPT2 train.micro_batch=8" "g16|$GPT2 train.micro_batch=16" "sm|--init-from $W/smol train.micro_batch=16"; do
  name=${run%%|*}; args=${run#*|}
  $NSYS profile -o $W/$name --trace=cuda --sample=none --cpuctxsw=none --force-overwrite true /tmp/kiln train --device cuda --out $W/r$name -q $common $args train.steps=30 > $OUT/$name.log 2>&1; echo "$name rc $?"
  $NSYS export --type sqlite -o $W/$name.sqlite --force-overwrite true $W/$name.nsys-rep > /dev/null 2>&1
  python3 gpubin/gaps.py $W/$name.sqlite 0.4
  grep -h tokens_per_s $W/r$name/metrics.jsonl | tail -1 | grep -o '"tokens_per_s":[0-9.]*'
done
# A/B: this build (cur) against the counting-sort embedding plan (emb), GPT-2 small 16 x 1024, alternating.
gunzip -c gpubin/kiln-emb.gz > /tmp/kiln-emb; chmod +x /tmp/kiln-emb
for i in 1 2; do for b in cur emb; do
  k=/tmp/kiln; [ $b = emb ] && k=/tmp/kiln-emb
  $k train --device cuda --out $W/ab$b$i -q $common $GPT2 train.micro_batch=16 train.steps=40 > /dev/null 2>&1
  python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$W/ab$b$i/metrics.jsonl')]; t=[x['tokens_per_s'] for x in r if x.get('kind')=='train' and x['step']>10]
print('$b', round(statistics.median(t)))"
done; done
$NSYS profile -o $W/e16 --trace=cuda --sample=none --cpuctxsw=none --force-overwrite true /tmp/kiln-emb train --device cuda --out $W/re16 -q $common $GPT2 train.micro_batch=16 train.steps=30 > /dev/null 2>&1
$NSYS export --type sqlite -o $W/e16.sqlite --force-overwrite true $W/e16.nsys-rep > /dev/null 2>&1
python3 gpubin/gaps.py $W/e16.sqlite 0.4
