#!/usr/bin/env bash
# kiln LoRA / QLoRA beside transformers + PEFT (`kiln bench finetune`, one command per shape)
# with the adapters' gradients cleared by their first write; then where the host spends a
# SmolLM2-shaped LoRA run's time (perf, when the machine has it).
set -u
xz -dc gpubin/kiln-new.xz > /tmp/kiln; xz -dc gpubin/kiln-sym.xz > /tmp/kiln-sym; chmod +x /tmp/kiln /tmp/kiln-sym
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
s=$(date +%s)
for shape in llama-3.2-1b smollm2-135m; do
  timeout 330 /tmp/kiln bench finetune --shape $shape --device cuda --out $OUT/$shape > $OUT/$shape.log 2>&1; echo "$shape rc $? t=$(( $(date +%s)-s ))"
  grep -A8 "^| engine" $OUT/$shape/report.md | head -9
done
rm -f $OUT/*/*.png
if command -v perf > /dev/null; then
  common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5"
  S135="model.kind=llama model.vocab=49152 model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.head_dim=64 model.ffn_hidden=1536 model.context=1024 model.rope_theta=100000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpubin/tok/tokenizer.json train.micro_batch=16"
  gunzip -c data/shakespeare.txt.gz > /tmp/shakespeare.txt
  /tmp/kiln train --device cuda --out /tmp/b -q --profile none $common $S135 train.steps=1 > /dev/null 2>&1
  /tmp/kiln export --run /tmp/b --to /tmp/bx > /dev/null 2>&1
  timeout 120 perf record -F 4000 -g -o /tmp/perf.data -- /tmp/kiln-sym finetune --device cuda --init-from /tmp/bx --data /tmp/shakespeare.txt --out /tmp/l -q --profile none $common $S135 lora.rank=16 lora.alpha=32 lora.targets=all-linear train.steps=40 train.save_final=false > /dev/null 2> $OUT/perf-record.err; echo "perf rc $?"
  perf report -i /tmp/perf.data --stdio --children --percent-limit 0.5 --sort symbol 2>/dev/null | grep -v '^$' | grep '^ ' | head -80 > $OUT/perf-children.txt
  grep -i 'adamw\|sum_squares\|upload\|clone_htod\|alloc\|optim' $OUT/perf-children.txt | head -30
else
  echo "no perf on this machine"
fi
