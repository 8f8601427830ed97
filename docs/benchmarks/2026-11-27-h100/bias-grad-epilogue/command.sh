#!/usr/bin/env bash
# Bias gradients from the weight-gradient product's epilogue (cuBLASLt BGRADB): the build of 22ac0c2
# (old) against this build (new), GPT-2 small bf16-mixed 8 x 1024, alternating; the kernel selftest;
# the new step's op trace; kiln bench train (kiln beside PyTorch eager and torch.compile) on the new build.
set -u
O=$OUT
gunzip -c gpubin/kiln-new.gz > /tmp/kiln-new; gunzip -c gpubin/kiln-base.gz > /tmp/kiln-base; chmod +x /tmp/kiln-new /tmp/kiln-base
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
timeout 300 /tmp/kiln-new selftest --only kernels > $O/selftest.txt 2>&1; echo "selftest rc $? t=$(( $(date +%s) - t0 ))"
grep -iE "checks, " $O/selftest.txt | tail -1; grep -E "FAIL" $O/selftest.txt | head; grep -E "^linear_backward|^linear_gelu" $O/selftest.txt | head -12
OUT=/tmp/ab ROUNDS=2 timeout 300 bash bench/ab_train_speed.sh /tmp/kiln-base /tmp/kiln-new | tee $O/ab.txt
echo "t=$(( $(date +%s) - t0 ))"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=8"
for b in base new; do
  timeout 100 /tmp/kiln-$b train --profile none -q --device cuda --out /tmp/t-$b $GPT2 train.steps=6 train.eval_every=0 train.checkpoint_every=0 train.save_final=false --trace /tmp/t-$b.json --trace-steps 4..=5 > /dev/null 2>&1
  python3 bench/trace_ops.py /tmp/t-$b.json > $O/trace_ops-$b.txt; head -8 $O/trace_ops-$b.txt
done
echo "t=$(( $(date +%s) - t0 ))"
timeout 280 /tmp/kiln-new bench train --device cuda --out $O/bt8 $GPT2 > $O/bt8.log 2>&1; echo "bench train rc $?"
grep -A10 "^## Engines side by side" $O/bt8/report.md | head -14
rm -f $O/bt8/*.png
echo "t=$(( $(date +%s) - t0 ))"
