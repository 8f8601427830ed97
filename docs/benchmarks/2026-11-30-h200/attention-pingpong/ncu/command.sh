#!/usr/bin/env bash
# Nsight Compute on the Hopper attention forwards: the engine's at head sizes 128 and 64, and
# the ping-pong warp-specialised one with 128-key tiles at head size 128.
set -u
R=$OUT
s=$(date +%s)
OUT=$R timeout 500 bash bench/wgmma_attention/ncu.sh wg_bf16_hs128_n64 ws_bf16_hs128_n128_s2q_pp wg_bf16_hs64_n64 > $R/ncu.log 2>&1; echo "ncu rc $? t=$(( $(date +%s)-s ))"
cat $R/ncu.log | cut -c1-220
