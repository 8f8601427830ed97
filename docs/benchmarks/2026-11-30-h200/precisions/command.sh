#!/usr/bin/env bash
# `kiln bench train` on GPT-2 small at micro-batch 8 in every precision kiln trains in, each
# beside PyTorch in the same command (bench/pytorch_gpt.py: eager and, for bf16 and fp16,
# torch.compile; fp16 with a GradScaler), on one H200.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln
K=/tmp/kiln
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.micro_batch=8"
for p in bf16-mixed fp16-mixed tf32 fp32; do
  timeout 200 $K bench train --device cuda --steps 10 --warmup 3 --out $R/$p $GPT2 train.precision=$p > $R/$p.log 2>&1
  echo "$p rc $? t=$(( $(date +%s)-s ))"
  grep -iE "tokens/s|speedup|x pytorch|ratio" $R/$p.log | head -8
done
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
