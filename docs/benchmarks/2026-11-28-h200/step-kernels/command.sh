#!/usr/bin/env bash
# Per-kernel device times (ncu, no cache flush, no clock lock) of the small kernels in a training step:
# GPT-2 small bf16-mixed 16 x 1024, and a Llama-3.2-1B-shaped LoRA step 8 x 1024.
set -u
gunzip -c gpubin/kiln-emb.gz > /tmp/kiln; chmod +x /tmp/kiln
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
nvidia-smi --query-gpu=name --format=csv,noheader
zcat data/shakespeare.txt.gz > /tmp/corpus.txt
s=$(date +%s)
M="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size"
C="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
R='regex:layernorm|accumulate|cross_entropy|embedding|sum_squares|adamw|gelu|residual|rmsnorm|rope|swiglu|add|copy|rows|column|gather'
timeout 200 $NCU --cache-control none --clock-control none --metrics $M -k "$R" --launch-skip 400 -c 150 --csv \
  /tmp/kiln train --profile none -q --device cuda --out /tmp/g2 $C $GPT2 train.steps=12 > $OUT/ncu_g2.csv 2> $OUT/ncu_g2.err; echo "g2 rc $? t=$(( $(date +%s)-s ))"
python3 gpubin/ncu_sum.py $OUT/ncu_g2.csv
python3 -c "import sys; sys.path.insert(0, 'bench'); import llama_parity as p; p.save(p.configs()[0][1], '/tmp/l1b', 'gpubin/tok')" > $OUT/save.txt 2>&1 || tail -3 $OUT/save.txt
timeout 250 $NCU --cache-control none --clock-control none --metrics $M -k "$R" --launch-skip 600 -c 300 --csv \
  /tmp/kiln finetune --init-from /tmp/l1b --data /tmp/corpus.txt --out /tmp/lorat --device cuda -q --profile none $C train.micro_batch=8 train.steps=6 > $OUT/ncu_lora.csv 2> $OUT/ncu_lora.err; echo "lora rc $? t=$(( $(date +%s)-s ))"
python3 gpubin/ncu_sum.py $OUT/ncu_lora.csv
