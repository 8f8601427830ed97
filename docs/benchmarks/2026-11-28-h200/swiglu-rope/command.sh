#!/usr/bin/env bash
# SwiGLU by rows with restrict-qualified, batched loads; rotary kernels loading a batch of heads
# before storing: kernel selftest, then the previous build (emb) and this one (ew) alternating on
# a Llama-3.2-1B-shaped LoRA step (8 x 1024) and SmolLM2-135M-shaped training (16 x 1024), ncu of the two kernels.
set -u
gunzip -c gpubin/kiln-emb.gz > /tmp/kiln-emb; gunzip -c gpubin/kiln-ew.gz > /tmp/kiln-ew; chmod +x /tmp/kiln-*
nvidia-smi --query-gpu=name --format=csv,noheader
zcat data/shakespeare.txt.gz > /tmp/corpus.txt
s=$(date +%s)
timeout 200 /tmp/kiln-ew selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "swiglu|rope|checks," $OUT/selftest.log | tail -14
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[0][1], '/tmp/l1b', 'gpubin/tok'); p.save(p.configs()[1][1], '/tmp/smol', 'gpubin/tok')" > $OUT/save.txt 2>&1 || tail -3 $OUT/save.txt
C="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.save_final=false"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>8]
print('$2', round(statistics.median(x['tokens_per_s'] for x in t)), 'loss', round(t[-1]['loss'],5))"; }
for i in 1 2; do for b in emb ew; do
  timeout 100 /tmp/kiln-$b finetune --init-from /tmp/l1b --data /tmp/corpus.txt --out /tmp/lo$b$i --device cuda -q --profile none $C train.micro_batch=8 train.steps=24 > /dev/null 2>&1; med /tmp/lo$b$i "lora-1b $b"
  timeout 100 /tmp/kiln-$b train --init-from /tmp/smol --out /tmp/sm$b$i --device cuda -q --profile none $C train.micro_batch=16 train.steps=30 > /dev/null 2>&1; med /tmp/sm$b$i "smol $b"
done; done
echo "t=$(( $(date +%s)-s ))"
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for b in emb ew; do
timeout 100 $NCU --cache-control none --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size -k "regex:swiglu|rope_expand" --launch-skip 64 -c 16 --csv \
  /tmp/kiln-$b finetune --init-from /tmp/l1b --data /tmp/corpus.txt --out /tmp/nc$b --device cuda -q --profile none $C train.micro_batch=8 train.steps=4 > $OUT/ncu_$b.csv 2>/dev/null; echo "== ncu $b rc $?"
python3 gpubin/ncu_sum.py $OUT/ncu_$b.csv
done
echo "t=$(( $(date +%s)-s ))"
