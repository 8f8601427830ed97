#!/usr/bin/env bash
# The deferred gradient clears on the GPU: CPU-vs-GPU training parity (`kiln selftest --only
# training`: 50 Trainer steps of a tiny GPT and ResNet-BK in four precisions against the CPU),
# then GPT-2 small bf16-mixed 16 x 1024 for 12 steps with the previous build (review, 6e2b188)
# and this one: the per-step losses, which overwriting a gradient instead of adding it to
# zeros should leave bit for bit the same.
set -u
for b in review pair; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
timeout 220 /tmp/kiln-pair selftest --only training > $OUT/selftest-training.log 2>&1; echo "selftest training rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|FAIL|PASS" $OUT/selftest-training.log | tail -14
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
for b in review pair; do
  timeout 60 /tmp/kiln-$b train --device cuda --out /tmp/g$b -q --profile none $common $GPT2 train.steps=12 > /dev/null 2>&1; echo "gpt2 $b rc $? t=$(( $(date +%s)-s ))"
  python3 -c "
import json; r=[json.loads(l) for l in open('/tmp/g$b/metrics.jsonl')]
print('$b', [repr(x['loss']) for x in r if x.get('kind')=='train'])" | tee $OUT/losses-$b.txt
done
