#!/usr/bin/env bash
# Full training beside transformers + torch.compile (SDPA, bf16 autocast) in one command on an
# H200: the Llama-3.2-1B shape (8 x 1024), then the SmolLM2-135M shape (16 x 1024) as far as
# the time allows; kiln starts from the random checkpoint transformers built and saved
# (bench/llama_parity.py's configurations), imported with --init-from.
set -u
xz -dc gpubin/kiln-new.xz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
s=$(date +%s)
W=/tmp/w; mkdir -p $W
left() { echo $(( $1 - ($(date +%s)-s) )); }
median() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print(json.dumps({'engine':'kiln','shape':'$2','tokens_per_s':round(statistics.median(x['tokens_per_s'] for x in t)),'peak_gib':round(max(x['mem_peak'] for x in t)/2**30,2)}))"; }
hf() { python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d.pop('losses',None); print(json.dumps(d))"; }
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=5 optim.warmup_steps=5 train.save_final=false"
for shape in l1b s135; do
  if [ $shape = l1b ]; then i=0; name=llama-3.2-1b; mb=8; else i=1; name=smollm2-135m; mb=16; fi
  timeout 90 python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[$i][1], '$W/$shape', 'gpubin/tok')" > /dev/null 2>&1 || echo "$shape save failed"
  echo "$shape saved t=$(( $(date +%s)-s ))"
  timeout 120 /tmp/kiln train --init-from $W/$shape --device cuda --out $W/k$shape -q $common train.micro_batch=$mb train.steps=25 > $OUT/k$shape.log 2>&1; echo "$shape kiln rc $? t=$(( $(date +%s)-s ))"; median $W/k$shape $name | tee -a $OUT/speed.jsonl
  t=$(left 430); echo "$shape compile gets $t s"
  timeout $t python3 bench/hf_llama_train.py --shape $name --batch $mb --seq 1024 --compile 2> $OUT/hf$shape.err | tail -1 | hf | tee -a $OUT/speed.jsonl
  echo "$shape compile t=$(( $(date +%s)-s ))"; tail -1 $OUT/hf$shape.err
done
