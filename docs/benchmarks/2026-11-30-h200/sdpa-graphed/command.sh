#!/usr/bin/env bash
# `kiln bench kernels` attention beside SDPA with the PyTorch side replayed from CUDA graphs
# (bench/pytorch_kernels.py, `graphed`): B 16 and B 4 at T 1024, B 4 at T 4096, head size 64.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln
K=/tmp/kiln
for cfg in ${CFGS:-"1024 16384" "1024 4096" "4096 16384"}; do
  set -- $cfg
  tag=t$1-rows$2
  timeout 110 $K bench kernels --only compute --dtypes bf16,f16 --seq $1 --rows $2 --out $R/$tag > $R/$tag.log 2>&1
  echo "$tag rc $? t=$(( $(date +%s)-s ))"
  grep -E "^attention.* [0-9.]+x$|^note|capture" $R/$tag.log | head -12
done
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
