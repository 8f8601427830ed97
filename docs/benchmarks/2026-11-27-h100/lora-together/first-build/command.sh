#!/usr/bin/env bash
# LoRA adapters run together (one x A^T kept for the backward; adapters first, base GEMM adding with beta 1):
# the binary of 8e8cf0d (base) against this build (new), alternating, Llama-3.2-1B and SmolLM2-135M shapes;
# a trace of the new step; kiln bench finetune at the 1B shape (kiln LoRA, QLoRA, transformers + PEFT).
set -u
O=$OUT
gunzip -c gpubin/kiln-new.gz > /tmp/kiln-new; gunzip -c gpubin/kiln-base.gz > /tmp/kiln-base; chmod +x /tmp/kiln-new /tmp/kiln-base
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
zcat data/shakespeare.txt.gz > /tmp/corpus.txt
t0=$(date +%s)
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[0][1], '/tmp/l1b', 'gpubin/tok'); p.save(p.configs()[1][1], '/tmp/smol', 'gpubin/tok')" > $O/save.txt 2>&1 || tail -3 $O/save.txt
echo "saved in $(( $(date +%s) - t0 )) s"
C="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.save_final=false"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train']
s=[x for x in t if x['step']>4]
print('$2', 'median tok/s', round(statistics.median(x['tokens_per_s'] for x in s)), 'peak GiB', round(max(x['mem_peak'] for x in s)/2**30,2), 'losses', [round(x['loss'],5) for x in t[:3]]+[round(t[-1]['loss'],5)])"; }
for b in base new base new; do
  rm -rf /tmp/l-$b; timeout 200 /tmp/kiln-$b finetune --init-from /tmp/l1b --data /tmp/corpus.txt --out /tmp/l-$b --device cuda -q --profile none $C train.micro_batch=8 train.steps=14 > $O/l1b-$b.txt 2>&1 || tail -3 $O/l1b-$b.txt
  med /tmp/l-$b "1B LoRA $b" | tee -a $O/ab.txt
done
for b in base new base new; do
  rm -rf /tmp/s-$b; timeout 200 /tmp/kiln-$b finetune --init-from /tmp/smol --data /tmp/corpus.txt --out /tmp/s-$b --device cuda -q --profile none $C train.micro_batch=16 train.steps=24 > $O/smol-$b.txt 2>&1 || tail -3 $O/smol-$b.txt
  med /tmp/s-$b "SmolLM2 LoRA $b" | tee -a $O/ab.txt
done
echo "t=$(( $(date +%s) - t0 ))"
timeout 200 /tmp/kiln-new finetune --init-from /tmp/l1b --data /tmp/corpus.txt --out /tmp/lorat --device cuda -q --profile none $C train.micro_batch=8 train.steps=6 --trace /tmp/lora.json --trace-steps 4..=5 > $O/lorat.txt 2>&1; echo "lora trace rc $?"
python3 bench/trace_ops.py /tmp/lora.json > $O/trace_lora_new.txt; head -24 $O/trace_lora_new.txt; gzip -c /tmp/lora.json > $O/lora-new.json.gz
echo "t=$(( $(date +%s) - t0 ))"
timeout 400 /tmp/kiln-new bench finetune --shape llama-3.2-1b --device cuda --out $O/bench-ft-1b > $O/bench-ft-1b.txt 2>&1; echo "bench finetune rc $?"
grep -A12 "^| engine" $O/bench-ft-1b/report.md | head -16
echo "t=$(( $(date +%s) - t0 ))"
