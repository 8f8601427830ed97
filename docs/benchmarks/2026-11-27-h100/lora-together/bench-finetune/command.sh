#!/usr/bin/env bash
# Final build: GPT-2 LoRA/QLoRA against PEFT (parity, greedy tokens; adapters trained with the grouped
# backward), then kiln bench finetune at both shapes (kiln LoRA, QLoRA, transformers + PEFT in one command).
set -u
O=$OUT
gunzip -c gpubin/kiln-new.gz > /tmp/kiln-new; chmod +x /tmp/kiln-new
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
KILN=/tmp/kiln-new OUT=/tmp/g2 timeout 240 bash bench/gpt2_lora_gpu_check.sh gpubin/tok 2>&1 | grep -v "Loading weights" > $O/gpt2_lora.txt; echo "gpt2 check rc $?"
tail -12 $O/gpt2_lora.txt
echo "t=$(( $(date +%s) - t0 ))"
for s in smollm2-135m llama-3.2-1b; do
  timeout 240 /tmp/kiln-new bench finetune --shape $s --device cuda --out $O/bench-ft-$s > $O/bench-ft-$s.txt 2>&1; echo "bench finetune $s rc $?"
  grep -A12 "^| engine" $O/bench-ft-$s/report.md | head -13
  echo "t=$(( $(date +%s) - t0 ))"
done
rm -f $O/bench-ft-*/*.png
