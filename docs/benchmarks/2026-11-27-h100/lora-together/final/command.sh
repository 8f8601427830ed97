#!/usr/bin/env bash
# Final build: selftest of the kernels; the binary of 8e8cf0d (base) against this build (new), alternating:
# Llama-3.2-1B-shaped LoRA and full training, SmolLM2-135M-shaped LoRA (bf16, steps after 4 timed).
set -u
O=$OUT
gunzip -c gpubin/kiln-new.gz > /tmp/kiln-new; gunzip -c gpubin/kiln-base.gz > /tmp/kiln-base; chmod +x /tmp/kiln-new /tmp/kiln-base
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
timeout 300 /tmp/kiln-new selftest --only kernels > $O/selftest.txt 2>&1; echo "selftest rc $? t=$(( $(date +%s) - t0 ))"
grep -iE "passed|failed" $O/selftest.txt | tail -2; grep -E "FAIL" $O/selftest.txt | head; grep -E "cross_entropy_fused|copy_into_at" $O/selftest.txt | head -12
zcat data/shakespeare.txt.gz > /tmp/corpus.txt
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[0][1], '/tmp/l1b', 'gpubin/tok'); p.save(p.configs()[1][1], '/tmp/smol', 'gpubin/tok')" > $O/save.txt 2>&1 || tail -3 $O/save.txt
echo "saved t=$(( $(date +%s) - t0 ))"
C="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.save_final=false"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train']
s=[x for x in t if x['step']>4]
print('$2', 'median tok/s', round(statistics.median(x['tokens_per_s'] for x in s)), 'peak GiB', round(max(x['mem_peak'] for x in s)/2**30,2), 'losses', [round(x['loss'],5) for x in t[:3]]+[round(t[-1]['loss'],5)])"; }
for b in base new base new; do
  rm -rf /tmp/l-$b; timeout 200 /tmp/kiln-$b finetune --init-from /tmp/l1b --data /tmp/corpus.txt --out /tmp/l-$b --device cuda -q --profile none $C train.micro_batch=8 train.steps=14 > $O/l1b-$b.txt 2>&1 || tail -3 $O/l1b-$b.txt
  med /tmp/l-$b "1B LoRA $b" | tee -a $O/ab.txt
done
for b in base new; do
  rm -rf /tmp/f-$b; timeout 200 /tmp/kiln-$b train --init-from /tmp/l1b --out /tmp/f-$b --device cuda -q --profile none $C train.micro_batch=8 train.steps=14 > $O/f1b-$b.txt 2>&1 || tail -3 $O/f1b-$b.txt
  med /tmp/f-$b "1B full $b" | tee -a $O/ab.txt
done
for b in base new; do
  rm -rf /tmp/s-$b; timeout 200 /tmp/kiln-$b finetune --init-from /tmp/smol --data /tmp/corpus.txt --out /tmp/s-$b --device cuda -q --profile none $C train.micro_batch=16 train.steps=24 > $O/smol-$b.txt 2>&1 || tail -3 $O/smol-$b.txt
  med /tmp/s-$b "SmolLM2 LoRA $b" | tee -a $O/ab.txt
done
timeout 100 /tmp/kiln-new train --init-from /tmp/l1b --out /tmp/ft --device cuda -q --profile none $C train.micro_batch=8 train.steps=6 --trace /tmp/full.json --trace-steps 4..=5 > /dev/null 2>&1
python3 bench/trace_ops.py /tmp/full.json > $O/trace_full_new.txt; grep -E "cross_entropy|phases" $O/trace_full_new.txt
echo "t=$(( $(date +%s) - t0 ))"
