#!/usr/bin/env bash
# 1. bench/wgmma_attention: the persistent warp-specialised forward (`wp_*`) beside the
#    engine's forward (`wg_*_n64`, cp.async and TMA), the non-persistent ping-pong one and SDPA.
# 2. The engine (`kiln-new`): attention kernel checks with its defaults (TMA forms on, now dQ's
#    at head size 128 too), with KILN_ATTENTION_PERSISTENT=1 (the persistent forward) and with
#    KILN_ATTENTION_TMA=0 (the threads' copies: the reference the others' lines are diffed
#    against); then `kiln bench kernels` B 4, T 4096, head size 128 in the three modes.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-new.xz > /tmp/kiln && chmod +x /tmp/kiln
export HARNESS_ONLY=wg_bf16_hs128_n64,wg_f16_hs128_n64,wg_bf16_hs128_n64_tma,wg_f16_hs128_n64_tma,wg_bf16_hs64_n64,wg_bf16_hs64_n64_tma,wg_f16_hs64_n64_tma,ws_bf16_hs128_n128_s2q_pp,wp_bf16_hs128_n128_s2_pp,wp_f16_hs128_n128_s2_pp,wp_bf16_hs128_n128_s2,wp_bf16_hs128_n64_s4_pp,wp_f16_hs128_n64_s4_pp,wp_bf16_hs128_n64_s4,wp_bf16_hs64_n128_s3_pp,wp_f16_hs64_n128_s3_pp,wp_bf16_hs64_n64_s4_pp,wp_bf16_hs64_n64_s4
OUT=$R TMA=1 timeout 240 bash bench/wgmma_attention/run.sh > $R/run.log 2>&1
echo "harness rc $? t=$(( $(date +%s)-s ))"
grep -E "regs|spills|FAIL|worst|checks:|WARNING" $R/run.log | head -40
grep -E "^time" $R/harness.txt
grep -E "hs 128|hs  64" $R/sdpa.txt | grep -E "default|cudnn|flash" | head -12
M=attention_forward,attention_backward
for mode in tma0 default persistent; do
  env=""; [ $mode = tma0 ] && env="KILN_ATTENTION_TMA=0"; [ $mode = persistent ] && env="KILN_ATTENTION_PERSISTENT=1"
  env $env timeout 150 /tmp/kiln selftest --only kernels --match $M > $R/selftest-$mode.log 2>&1
  echo "selftest $mode rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-$mode.log)"
done
for mode in default persistent; do
  diff <(grep -E "PASS|FAIL" $R/selftest-tma0.log) <(grep -E "PASS|FAIL" $R/selftest-$mode.log) > $R/selftest-diff-$mode.txt
  echo "$mode: lines differing from tma0: $(grep -c '^<' $R/selftest-diff-$mode.txt)"; head -6 $R/selftest-diff-$mode.txt
done
for round in 1 2; do
  for mode in tma0 default persistent; do
    env=""; [ $mode = tma0 ] && env="KILN_ATTENTION_TMA=0"; [ $mode = persistent ] && env="KILN_ATTENTION_PERSISTENT=1"
    tag=$mode-r$round
    env $env timeout 100 /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 --channels 2048 --heads 16 --no-python --reps 10 --out $R/$tag > $R/$tag.log 2>&1
    echo "$tag rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_(forward|backward) ' $R/$tag.log | awk '{print $1, $2, $7}' | paste -sd' ')"
  done
done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
