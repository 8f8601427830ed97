#!/usr/bin/env bash
# This build (f16 dK/dV bound scales, column sums by four): GPT-2 small bf16-mixed 16 x 1024
# beside PyTorch eager and torch.compile; Llama-3.2-1B-shaped LoRA/QLoRA beside PEFT.
set -u
gunzip -c gpubin/kiln-new.gz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
s=$(date +%s)
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=16"
timeout 230 /tmp/kiln bench train --device cuda --out $OUT/bt16 $GPT2 > $OUT/bt16.log 2>&1; echo "bt16 rc $? t=$(( $(date +%s)-s ))"
grep -A8 "^## Engines side by side" $OUT/bt16/report.md | head -10
timeout 300 /tmp/kiln bench finetune --shape llama-3.2-1b --device cuda --out $OUT/ft1b > $OUT/ft1b.log 2>&1; echo "ft1b rc $? t=$(( $(date +%s)-s ))"
grep -A12 "^| engine" $OUT/ft1b/report.md | head -13
rm -f $OUT/*/*.png
