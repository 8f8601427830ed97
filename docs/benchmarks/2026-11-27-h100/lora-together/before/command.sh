#!/usr/bin/env bash
# Op traces of a Llama-3.2-1B-shaped step: LoRA (rank 16, all-linear) and full training, bf16, 8 x 1024.
set -u
O=$OUT
gunzip -c gpubin/kiln-new.gz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
zcat data/shakespeare.txt.gz > /tmp/corpus.txt
t0=$(date +%s)
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[0][1], '/tmp/l1b', 'gpubin/tok')" > $O/save1b.txt 2>&1 || tail -3 $O/save1b.txt
echo "saved in $(( $(date +%s) - t0 )) s"
C="train.precision=bf16-mixed train.seq_len=1024 train.micro_batch=8 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.save_final=false"
timeout 200 /tmp/kiln finetune --init-from /tmp/l1b --data /tmp/corpus.txt --out /tmp/lora --device cuda -q --profile none $C train.steps=12 > $O/lora.txt 2>&1; echo "lora rc $?"
python3 -c "
import json,statistics; r=[json.loads(l) for l in open('/tmp/lora/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>4]
print('lora median tok/s', statistics.median(x['tokens_per_s'] for x in t), 'peak GiB', max(x['mem_peak'] for x in t)/2**30)"
timeout 200 /tmp/kiln finetune --init-from /tmp/l1b --data /tmp/corpus.txt --out /tmp/lorat --device cuda -q --profile none $C train.steps=6 --trace /tmp/lora.json --trace-steps 4..=5 > $O/lorat.txt 2>&1; echo "lora trace rc $?"
python3 bench/trace_ops.py /tmp/lora.json > $O/trace_lora.txt; head -34 $O/trace_lora.txt
timeout 200 /tmp/kiln train --init-from /tmp/l1b --out /tmp/fullt --device cuda -q --profile none $C train.steps=6 --trace /tmp/full.json --trace-steps 4..=5 > $O/fullt.txt 2>&1; echo "full trace rc $?"
python3 bench/trace_ops.py /tmp/full.json > $O/trace_full.txt; head -34 $O/trace_full.txt
gzip -c /tmp/lora.json > $O/lora.json.gz; gzip -c /tmp/full.json > $O/full.json.gz
echo "t=$(( $(date +%s) - t0 ))"
