#!/usr/bin/env bash
# A layernorm's gain and bias partial sums added in one launch: kernel selftest of the new
# build, GPT-2 small bf16-mixed 16 x 1024 with the lazy-clear build and this one alternating
# twice; then every kernel of SmolLM2-135M decode steps at batch 64 without CUDA graphs, for
# where a step's time goes.
set -u
for b in lazy pair; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 240 /tmp/kiln-pair selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
grep -E "^layernorm_backward" $OUT/selftest.log | head -12
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print('$2 median tokens/s', round(statistics.median(x['tokens_per_s'] for x in t)), 'steps', len(t))"; }
for round in 1 2; do
  for b in lazy pair; do
    timeout 100 /tmp/kiln-$b train --device cuda --out /tmp/g$b$round -q --profile none $common $GPT2 train.steps=40 > $OUT/gpt2-$b-$round.log 2>&1; echo "gpt2 $b rc $? t=$(( $(date +%s)-s ))"; med /tmp/g$b$round "gpt2 $b $round"
  done
done
NSYS=$(which nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys 2>/dev/null | head -1)
echo "nsys: $NSYS"
if [ -n "$NSYS" ]; then
  timeout 150 $NSYS profile -o /tmp/dec --force-overwrite true -t cuda /tmp/kiln-pair bench generate --shape smollm2-135m --batches 64 --new-tokens 32 --no-python --no-cuda-graphs --out /tmp/bgd > $OUT/nsys.log 2>&1; echo "nsys rc $? t=$(( $(date +%s)-s ))"
  timeout 60 $NSYS stats -r cuda_gpu_kern_sum --format csv -o $OUT/decode /tmp/dec.nsys-rep > /dev/null 2>&1; echo "stats rc $?"; ls $OUT
  head -40 $OUT/decode*.csv | cut -c1-220
fi
