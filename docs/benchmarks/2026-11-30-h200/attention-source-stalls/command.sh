#!/usr/bin/env bash
# Warp-stall sampling by instruction of the engine's head-size-128 Hopper attention forward.
set -u
R=$OUT
s=$(date +%s)
OUT=$R timeout 300 bash bench/wgmma_attention/ncu_source.sh wg_bf16_hs128_n64 > $R/source.txt 2>&1; echo "rc $? t=$(( $(date +%s)-s ))"
head -c 9000 $R/source.txt
rm -f $R/*.ncu-rep
