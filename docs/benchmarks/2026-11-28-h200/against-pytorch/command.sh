#!/usr/bin/env bash
# This build against PyTorch on an H200: the Llama-3.2-1B shape, full training 8 x 1024 (kiln
# from a random transformers-built checkpoint; transformers + torch.compile, SDPA, bf16
# autocast), then LoRA rank 16 (kiln LoRA and QLoRA; transformers + PEFT) as far as the time
# allows.
set -u
gunzip -c gpubin/kiln-pair.gz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
s=$(date +%s)
W=/tmp/w; mkdir -p $W
timeout 90 python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[0][1], '$W/l1b', 'gpubin/tok')" > /dev/null 2>&1 || echo "save failed"
echo "saved t=$(( $(date +%s)-s ))"
median() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print(json.dumps({'engine':'kiln','shape':'$2','tokens_per_s':round(statistics.median(x['tokens_per_s'] for x in t)),'peak_gib':round(max(x['mem_peak'] for x in t)/2**30,2)}))"; }
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=5 optim.warmup_steps=5 train.save_final=false"
timeout 120 /tmp/kiln train --init-from $W/l1b --device cuda --out $W/k1b -q $common train.micro_batch=8 train.steps=25 > $OUT/k1b.log 2>&1; echo "k1b rc $?"; median $W/k1b llama-3.2-1b | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"
timeout 240 python3 bench/hf_llama_train.py --shape llama-3.2-1b --batch 8 --seq 1024 --compile 2> $OUT/hf1bc.err | tail -1 | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d.pop('losses',None); print(json.dumps(d))" | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"; tail -2 $OUT/hf1bc.err
left=$(( 560 - ($(date +%s)-s) ))
echo "finetune gets $left s"
timeout $left /tmp/kiln bench finetune --shape llama-3.2-1b --device cuda --out $OUT/ft1b > $OUT/ft1b.log 2>&1; echo "ft1b rc $? t=$(( $(date +%s)-s ))"
grep -A12 "^| engine" $OUT/ft1b/report.md | head -13
rm -f $OUT/*/*.png
