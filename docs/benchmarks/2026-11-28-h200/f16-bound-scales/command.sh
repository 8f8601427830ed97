#!/usr/bin/env bash
# f16 dK/dV scales from per-head bounds, column sums four columns a thread, partials added 32
# at a time: kernel selftest of the new build, attention f16 before/after at head sizes 64 and
# 128 (T 4096, B 4), GPT-2 small bf16-mixed 16 x 1024 before/after alternating.
set -u
for b in base new; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
s=$(date +%s)
timeout 220 /tmp/kiln-new selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
grep -E "attention.*(f16|bf16).*backward" $OUT/selftest.log | head -30
for hs in 64 128; do
  a=""; [ $hs = 128 ] && a="--channels 2048 --heads 16"
  for b in base new base new; do
    timeout 100 /tmp/kiln-$b bench kernels --only compute --rows 16384 --seq 4096 --dtypes f16 --vocab 1024 $a --out /tmp/k-$b > $OUT/kernels-$b-hs$hs.log 2>&1
    echo "== $b head size $hs, T 4096 (rc $?, t=$(( $(date +%s)-s )))"; grep -E "^attention" $OUT/kernels-$b-hs$hs.log
  done
done
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2"
for i in 1 2; do for b in base new; do
  timeout 90 /tmp/kiln-$b train --device cuda --out /tmp/ab$b$i -q --profile none $common $GPT2 train.micro_batch=16 train.steps=40 > /dev/null 2>&1
  python3 -c "
import json,statistics; r=[json.loads(l) for l in open('/tmp/ab$b$i/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print('gpt2-16 $b', round(statistics.median(x['tokens_per_s'] for x in t)), 'loss', round(t[-1]['loss'],5))"
done; done
echo "t=$(( $(date +%s)-s ))"
