#!/usr/bin/env bash
# Attention at T 8192 (B 4), head sizes 64 and 128, bf16 and f16, beside SDPA in the same
# command (`kiln bench kernels --only compute`).
set -u
R=$OUT
xz -dc gpubin/kiln-g7.xz > /tmp/kiln-g7 && chmod +x /tmp/kiln-g7
s=$(date +%s)
timeout 240 /tmp/kiln-g7 bench kernels --only compute --dtypes bf16,f16 --seq 8192 --rows 32768 --out $R/hs64 > $R/hs64.log 2>&1; echo "hs64 rc $? t=$(( $(date +%s)-s ))"
grep -iE "attention" $R/hs64.log | head -20
timeout 240 /tmp/kiln-g7 bench kernels --only compute --dtypes bf16,f16 --seq 8192 --rows 32768 --channels 2048 --heads 16 --out $R/hs128 > $R/hs128.log 2>&1; echo "hs128 rc $? t=$(( $(date +%s)-s ))"
grep -iE "attention" $R/hs128.log | head -20
rm -f $R/hs*/*.png
