#!/usr/bin/env bash
# The kept build (forward tiles from a counter over sections of heads, backward blocks longest
# first by sections) beside SDPA replayed from CUDA graphs, one command: `kiln bench kernels`,
# B 4, head size 64 (12 heads) and 128 (16 heads), T 1024, 4096 and 8192. Run from the
# repository root with gpubin/kiln-new.xz.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-new.xz > /tmp/kiln && chmod +x /tmp/kiln
for hs in 64 128; do for t in 4096 1024 8192; do
  [ $(( $(date +%s)-s )) -gt 400 ] && { echo "hs$hs-t$t skipped (time)"; continue; }
  ch=$(( hs == 128 ? 2048 : 768 )); nh=$(( hs == 128 ? 16 : 12 ))
  timeout 90 /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq $t --rows $((4 * t)) --channels $ch --heads $nh --reps 10 --out $R/hs$hs-t$t > $R/hs$hs-t$t.log 2>&1
  echo "hs$hs-t$t rc $? t=$(( $(date +%s)-s ))"
  grep -hE "^attention_(forward|backward|forward\+backward) +(bf16|f16) +B4.*x$" $R/hs$hs-t$t.log
done; done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
