#!/usr/bin/env bash
# The embedding backward with staged positions and 32 loads in flight: kernel selftest, then
# GPT-2 small bf16-mixed 16 x 1024 before (prev) and after (new) alternating, and ncu of the
# kernel alone in one step of each.
set -u
for b in prev new; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
timeout 200 /tmp/kiln-new selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks,|FAIL" $OUT/selftest.log | head; grep -E "embedding" $OUT/selftest.log
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
for i in 1 2; do for b in prev new; do
  timeout 60 /tmp/kiln-$b train --device cuda --out /tmp/ab$b$i -q --profile none $common $GPT2 train.steps=40 > /dev/null 2>&1
  python3 -c "
import json,statistics; r=[json.loads(l) for l in open('/tmp/ab$b$i/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print('gpt2-16 $b', round(statistics.median(x['tokens_per_s'] for x in t)), 'loss', round(t[-1]['loss'],5))"
done; done
echo "t=$(( $(date +%s)-s ))"
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for b in prev new; do
  timeout 60 $NCU --profile-from-start off --cache-control none --clock-control none --metrics gpu__time_duration.sum -k regex:embedding_backward --csv \
    /tmp/kiln-$b train --device cuda --out /tmp/nc$b -q --profile none $common $GPT2 train.steps=3 --profile-steps 3..=3 2>/dev/null | grep -E "gpu__time" | awk -F'","' '{print "'$b'", $5, $(NF-1), $NF}'
done
echo "t=$(( $(date +%s)-s ))"
