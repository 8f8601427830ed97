#!/usr/bin/env bash
# Nsight Compute details (speed of light, memory, occupancy, warp states) of the memory-bound
# kernels of one training step: Llama-3.2-1B shape 8 x 1024 and GPT-2 small 16 x 1024, bf16-mixed.
set -u
gunzip -c gpubin/kiln-new.gz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
L1B="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2 train.micro_batch=8"
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
SEC="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats"
timeout 200 /tmp/kiln train --device cuda --out /tmp/warm -q --profile none $common $GPT2 train.steps=1 > /dev/null 2>&1; echo "warm rc $? t=$(( $(date +%s)-s ))"
n=0
for rx in "rope_expand_forward|residual_rmsnorm|swiglu_forward:6" "cross_entropy|swiglu_backward|rmsnorm_backward_fused|rope_expand_backward:5"; do
  n=$((n+1))
  timeout 150 $NCU --profile-from-start off --cache-control none --clock-control none $SEC -k regex:"${rx%:*}" -c ${rx##*:} --csv --page details \
    /tmp/kiln train --device cuda --out /tmp/n1$n -q --profile none $common $L1B train.steps=3 --profile-steps 3..=3 > $OUT/l1b_details$n.csv 2>/dev/null; echo "ncu 1b $n rc $? t=$(( $(date +%s)-s ))"
  python3 docs/benchmarks/2026-11-28-h200/memory-bound-kernels/ncu_details.py $OUT/l1b_details$n.csv
done
timeout 150 $NCU --profile-from-start off --cache-control none --clock-control none $SEC -k regex:"layernorm_backward_fused|residual_layernorm|cross_entropy" -c 4 --csv --page details \
  /tmp/kiln train --device cuda --out /tmp/n2 -q --profile none $common $GPT2 train.steps=3 --profile-steps 3..=3 > $OUT/gpt2_details.csv 2>/dev/null; echo "ncu gpt2 rc $? t=$(( $(date +%s)-s ))"
python3 docs/benchmarks/2026-11-28-h200/memory-bound-kernels/ncu_details.py $OUT/gpt2_details.csv
gzip -f $OUT/*.csv
