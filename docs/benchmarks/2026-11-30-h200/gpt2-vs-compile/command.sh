#!/usr/bin/env bash
# `kiln bench train` on GPT-2 small bf16-mixed at micro-batch 8 and 16 beside PyTorch eager and
# torch.compile in the same command (bench/pytorch_gpt.py), with the build of
# ../host-formatting/ (new), on one H200.
set -u
s=$(date +%s)
xz -dc gpubin/kiln-new.xz > /tmp/kiln && chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed"
for mb in 8 16; do
  timeout 240 /tmp/kiln bench train --device cuda --steps 10 --warmup 3 --out $OUT/mb$mb $GPT2 train.micro_batch=$mb > $OUT/mb$mb.log 2>&1
  echo "mb$mb rc $? t=$(( $(date +%s)-s ))"
  grep -A6 "^## Engines side by side" $OUT/mb$mb/report.md | head -8
done
rm -f $OUT/*/*.png
