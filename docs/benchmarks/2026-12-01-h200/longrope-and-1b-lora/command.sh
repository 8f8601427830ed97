#!/usr/bin/env bash
# From the repository root on the GPU machine: gpubin/kiln-new.xz is the release build of the
# commit under test (stripped, xz), gpubin/tok the SmolLM2-135M-Instruct tokenizer files as
# `kiln export --init-from` writes them from the fixture GGUF.
# 1. LongRoPE against transformers: past the trained context, and generation crossing it.
# 2. `kiln bench finetune` at the Llama-3.2-1B shape beside transformers + PEFT.
# 3. A traced GPT-2 small step (ops timed by device events) for the in-run split.
set -u
xz -dc gpubin/kiln-new.xz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
s=$(date +%s)
(time python3 bench/phi3_parity.py --kiln /tmp/kiln --tokenizer gpubin/tok --work /tmp/phi3 --only-long) > $OUT/phi3-long.log 2>&1; echo "phi3 rc $? t=$(( $(date +%s)-s ))"
grep -v "Loading weights" $OUT/phi3-long.log | tail -12
timeout 330 /tmp/kiln bench finetune --shape llama-3.2-1b --device cuda --out $OUT/llama-3.2-1b > $OUT/llama-3.2-1b.log 2>&1; echo "finetune rc $? t=$(( $(date +%s)-s ))"
grep -A8 "^| engine" $OUT/llama-3.2-1b/report.md | head -9
rm -f $OUT/*/*.png
gunzip -c data/shakespeare.txt.gz > /tmp/shakespeare.txt 2>/dev/null
timeout 120 /tmp/kiln train --device cuda --out /tmp/g2 -q --profile none --trace $OUT/gpt2.json --trace-steps 4..=5 model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=16 train.steps=8 train.eval_every=0 train.checkpoint_every=0 train.save_final=false > $OUT/gpt2-trace.log 2>&1; echo "trace rc $? t=$(( $(date +%s)-s ))"
python3 bench/trace_gaps.py $OUT/gpt2.json --by-op | head -20
gzip -f $OUT/gpt2.json
