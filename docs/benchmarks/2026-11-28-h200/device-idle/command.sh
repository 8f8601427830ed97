#!/usr/bin/env bash
# Device idle time inside the forward+backward phase, from traces whose ops carry queued_us:
# GPT-2 small 16 x 1024, the Llama-3.2-1B shape (full training, 8 x 1024), and LoRA rank 16
# (all linear layers) at the SmolLM2-135M shape, 16 x 1024. bf16-mixed throughout.
set -u
gunzip -c gpubin/kiln-new.gz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
L1B="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2 train.micro_batch=8"
S135="model.kind=llama model.vocab=49152 model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.head_dim=64 model.ffn_hidden=1536 model.context=1024 model.rope_theta=100000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2 train.micro_batch=16"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>$3]
print('$2 median tokens/s', round(statistics.median(x['tokens_per_s'] for x in t)), 'steps', len(t))"; }
timeout 200 /tmp/kiln train --device cuda --out /tmp/g -q --profile none $common $GPT2 train.steps=30 > /dev/null 2>&1; echo "gpt2 rc $? t=$(( $(date +%s)-s ))"; med /tmp/g gpt2-16 10
timeout 100 /tmp/kiln train --device cuda --out /tmp/gt -q --profile none $common $GPT2 train.steps=6 --trace $OUT/gpt2.json --trace-steps 4..=5 > /dev/null 2>&1; echo "gpt2 trace rc $?"
python3 bench/trace_gaps.py $OUT/gpt2.json
timeout 200 /tmp/kiln train --device cuda --out /tmp/f -q --profile none $common $L1B train.steps=14 --trace $OUT/l1b.json --trace-steps 12..=13 > /dev/null 2>&1; echo "1b rc $? t=$(( $(date +%s)-s ))"; med /tmp/f l1b-full 4
python3 bench/trace_gaps.py $OUT/l1b.json
timeout 100 /tmp/kiln train --device cuda --out /tmp/sb -q --profile none $common $S135 train.steps=1 train.save_final=true > /dev/null 2>&1; echo "base rc $?"
timeout 100 /tmp/kiln export --run /tmp/sb --to /tmp/sbx > /dev/null 2>&1; echo "export rc $? t=$(( $(date +%s)-s ))"
gunzip -c data/shakespeare.txt.gz > /tmp/shakespeare.txt
timeout 100 /tmp/kiln finetune --device cuda --init-from /tmp/sbx --data /tmp/shakespeare.txt --out /tmp/sl -q --profile none $common $S135 lora.rank=16 lora.alpha=32 lora.targets=all-linear train.steps=24 --trace $OUT/lora135.json --trace-steps 20..=21 > /dev/null 2>&1; echo "lora rc $? t=$(( $(date +%s)-s ))"; med /tmp/sl lora135 5
python3 bench/trace_gaps.py $OUT/lora135.json
gzip -f $OUT/*.json
