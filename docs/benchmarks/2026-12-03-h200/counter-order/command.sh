#!/usr/bin/env bash
# Two work-order trials against the kept build, one command. Forward: the persistent forward's
# tiles handed out by a counter in global memory over sections of heads whose K and V fill
# about 24 MiB of L2 (`kiln-csec`: WG_ORDER_COUNTER_SECTIONS) against `kiln-kept` (WG_ORDER_SNAKE). Backward: `kiln-blpt`
# (WG_BACKWARD_ORDER 1: every head's longest tile first) and `kiln-bsec` (2: that within
# sections of heads) against the grid's own order. Each trial build's attention checks, then
# `kiln bench kernels` alternating the builds, B 4, head size 128 (16 heads) and 64 (12 heads).
# Run from the repository root with the binaries in gpubin/.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in kept csec bsec; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
for b in csec; do
  timeout 100 /tmp/kiln-$b selftest --only kernels --match attention_forward > $R/selftest-$b.log 2>&1
  echo "selftest $b rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-$b.log)"; grep FAIL $R/selftest-$b.log | head -3
done
timeout 100 /tmp/kiln-bsec selftest --only kernels --match attention_backward > $R/selftest-bsec.log 2>&1
echo "selftest bsec rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-bsec.log)"; grep FAIL $R/selftest-bsec.log | head -3
bench() {  # tag, build, seq, head size
  [ $(( $(date +%s)-s )) -gt 520 ] && { echo "$1 skipped (time)"; return; }
  local ch=$(( $4 == 128 ? 2048 : 768 )) nh=$(( $4 == 128 ? 16 : 12 ))
  timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq $3 --rows $((4 * $3)) --channels $ch --heads $nh --reps 10 --no-python --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) fwd $(grep -E '^attention_forward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ') bwd $(grep -E '^attention_backward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ')"
}
for b in kept csec bsec; do bench hs128-t4096-$b $b 4096 128; done
for b in kept csec bsec; do bench hs64-t4096-$b $b 4096 64; done
for b in kept csec bsec; do bench hs128-t8192-$b $b 8192 128; done
for b in kept bsec; do bench hs64-t1024-$b $b 1024 64; done
for b in kept csec bsec; do bench hs128-t4096-$b-r2 $b 4096 128; done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
