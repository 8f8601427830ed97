#!/usr/bin/env bash
# The persistent forward at head size 64 with three consumer warpgroups (192-query work tiles,
# 128-key tiles, two stages, turns in a ring), now sm_90's default there, against the
# one-warpgroup TMA forward (`KILN_ATTENTION_PERSISTENT=0`), one binary: the attention kernel
# checks in both modes (lines diffed) and the value-bound check; `kiln bench kernels` at head
# size 64 alternating the two, two rounds at T 4096 and one at 1024 and 8192; the attention
# rows beside PyTorch's SDPA (replayed from CUDA graphs) at T 1024, 4096 and 8192; then the
# harness's persistent configurations (checked against the CPU, timed beside the engine's
# forwards and SDPA). Run from the repository root with the binary in gpubin/.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-c3.xz > /tmp/kiln && chmod +x /tmp/kiln
for m in default 0; do
  KILN_ATTENTION_PERSISTENT=$m timeout 150 /tmp/kiln selftest --only kernels --match attention_forward,attention_backward > $R/selftest-$m.log 2>&1
  echo "selftest $m rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-$m.log)"
done
diff <(grep -E "PASS|FAIL" $R/selftest-default.log) <(grep -E "PASS|FAIL" $R/selftest-0.log) > $R/selftest-diff.txt
echo "lines differing: $(grep -c '^<' $R/selftest-diff.txt)"; head -10 $R/selftest-diff.txt
timeout 60 /tmp/kiln selftest --only kernels --match attention_value_bound > $R/selftest-value-bound.log 2>&1
echo "value bound rc $? $(grep -E 'attention_value_bound|checks,' $R/selftest-value-bound.log | head -6 | paste -sd' ')"
bench() {  # tag, mode, seq, extra flags
  [ $(( $(date +%s)-s )) -gt 470 ] && { echo "$1 skipped (time)"; return; }
  KILN_ATTENTION_PERSISTENT=$2 timeout 80 /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq $3 --rows $((4 * $3)) --channels 768 --heads 12 --reps 10 $4 --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s ))"; grep -E '^attention_(forward|backward) ' $R/$1.log | head -8
}
for round in 1 2; do for m in default 0; do bench t4096-$m-r$round $m 4096 --no-python; done; done
for seq in 1024 8192; do for m in default 0; do bench t$seq-$m $m $seq --no-python; done; done
for seq in 1024 4096 8192; do bench sdpa-t$seq default $seq ""; done
if [ $(( $(date +%s)-s )) -lt 470 ]; then
  HARNESS_ONLY=wg_bf16_hs64_n64_tma,wg_f16_hs64_n64_tma,wp_bf16_hs64_n128_s3_pp,wp_bf16_hs64_n128_s2_pp_c3,wp_f16_hs64_n128_s2_pp_c3,wp_bf16_hs64_n128_s3_pp_c3 \
    OUT=$R TMA=1 timeout $(( 585 - ($(date +%s)-s) )) bash bench/wgmma_attention/run.sh quick > $R/harness-run.log 2>&1
  echo "harness rc $? t=$(( $(date +%s)-s ))"
  grep -E "regs|worst vs cpu|checks:|FAIL" $R/harness-run.log | head -20
  grep -E "^time .*hs  64" $R/harness-run.log
fi
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
