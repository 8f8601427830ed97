#!/usr/bin/env bash
# cuBLASLt's GELU epilogues at GPT-2 small's MLP shapes (bench/gelu_epilogues/harness.cu), then
# `kiln bench kernels` attention at B 16, T 1024 (GPT-2 small's micro-batch 16) beside SDPA.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln
K=/tmp/kiln
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/gelu_epilogues bench/gelu_epilogues/harness.cu -lcublasLt > $R/nvcc.txt 2>&1; echo "nvcc rc $? t=$(( $(date +%s)-s ))"; grep -i error $R/nvcc.txt | head
timeout 200 /tmp/gelu_epilogues | tee $R/gelu_epilogues.txt; echo "harness rc $? t=$(( $(date +%s)-s ))"
timeout 240 $K bench kernels --only compute --dtypes bf16,f16 --seq 1024 --rows 16384 --out $R/b16-t1024 > $R/b16-t1024.log 2>&1; echo "bench rc $? t=$(( $(date +%s)-s ))"
grep -E "attention" $R/b16-t1024.log | head -20
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
cp $R/gelu_epilogues.txt $OUT/ 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
