#!/usr/bin/env bash
# Attention beside SDPA (replayed from CUDA graphs) after f16's dQ takes its dO norms from the
# row term's read: `kiln bench kernels`, B 4, head size 64 (12 heads) and 128 (16), T 1024,
# 4096 and 8192, bf16 and f16, one command a shape. Build: gpubin/kiln-fqmodes.xz (this
# commit's kernels on its default path; KILN_ATTENTION_FUSED_DQ unset). Run from the
# repository root on the GPU machine.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-fqmodes.xz > /tmp/kiln && chmod +x /tmp/kiln
for t in 4096 1024 8192; do for hs in "64 768 12" "128 2048 16"; do set -- $hs
  [ $(( $(date +%s)-s )) -gt 480 ] && { echo "hs$1-t$t skipped (time)"; continue; }
  timeout 100 /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq $t --rows $((4 * t)) --channels $2 --heads $3 --reps 10 --out $R/hs$1-t$t > $R/hs$1-t$t.log 2>&1
  echo "hs$1-t$t rc $? t=$(( $(date +%s)-s ))"; grep -hE "^attention_(forward|backward|forward\+backward) +(bf16|f16) +B4.*x$" $R/hs$1-t$t.log
done; done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
