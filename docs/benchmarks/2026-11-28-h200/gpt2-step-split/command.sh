#!/usr/bin/env bash
# GPT-2 small bf16-mixed 16 x 1024: every kernel of the third step under Nsight Compute (times
# with caches and clocks as in a run), beside the step's wall time from the same binary.
set -u
gunzip -c gpubin/kiln-new.gz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
timeout 90 /tmp/kiln train --device cuda --out /tmp/wall -q --profile none $common $GPT2 train.steps=30 > /dev/null 2>&1
python3 -c "
import json,statistics; r=[json.loads(l) for l in open('/tmp/wall/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print('wall: median tokens/s', round(statistics.median(x['tokens_per_s'] for x in t)), 'ms/step', round(16384e3/statistics.median(x['tokens_per_s'] for x in t),2))"
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 400 $NCU --profile-from-start off --cache-control none --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed --csv \
  /tmp/kiln train --device cuda --out /tmp/nc -q --profile none $common $GPT2 train.steps=4 --profile-steps 3..=3 > $OUT/ncu.csv 2>/dev/null; echo "ncu rc $? t=$(( $(date +%s)-s ))"
python3 docs/benchmarks/2026-11-28-h200/gpt2-step-split/ncu_steps.py $OUT/ncu.csv -1 | tee $OUT/step2.txt | head -50
gzip -f $OUT/ncu.csv
