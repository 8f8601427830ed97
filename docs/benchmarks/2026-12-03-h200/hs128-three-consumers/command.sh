#!/usr/bin/env bash
# Three consumer warpgroups at head size 128 (192-query work tiles, 64-key tiles, two or three
# stages, turns in a ring) against the engine's two-consumer persistent forward (128-key
# tiles) and its one-warpgroup TMA forward, in the harness (checked against the CPU, timed
# beside SDPA). Run from the repository root on a Hopper GPU.
set -u
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
HARNESS_ONLY=wg_bf16_hs128_n64_tma,wp_bf16_hs128_n128_s2_pp,wp_f16_hs128_n128_s2_pp,wp_bf16_hs128_n64_s2_pp_c3,wp_bf16_hs128_n64_s3_pp_c3,wp_f16_hs128_n64_s3_pp_c3 \
  OUT=$R TMA=1 timeout 400 bash bench/wgmma_attention/run.sh quick > $R/harness-run.log 2>&1
echo "harness rc $?"
grep -E "regs|worst vs cpu|checks:|FAIL|WARNING" $R/harness-run.log | head -20
grep -E "^time .*hs 128" $R/harness-run.log
tail -8 $R/summary.txt
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
