#!/usr/bin/env bash
# Where the fused backward's time goes (after command.sh): the same kernel with its dQ copies
# in turn (KILN_ATTENTION_FUSED_DQ=1), added in no fixed order (`unordered`, timing only) and
# left in shared memory (`local`, timing only), beside the kept build (gpubin/kiln-dkv64.xz),
# `kiln bench kernels`, B 4, 16 heads of 128, T 4096 twice. Build: gpubin/kiln-fqmodes.xz.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-dkv64.xz > /tmp/kiln-kept && xz -dc gpubin/kiln-fqmodes.xz > /tmp/kiln-modes && chmod +x /tmp/kiln-*
bench() {  # tag, build, mode, seq
  [ $(( $(date +%s)-s )) -gt 400 ] && { echo "$1 skipped (time)"; return; }
  KILN_ATTENTION_FUSED_DQ=$3 timeout 120 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq $4 --rows $((4 * $4)) --channels 2048 --heads 16 --reps 10 --no-python --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) bwd $(grep -E '^attention_backward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ')"
}
for r in 1 2; do
  for b in "kept kept 0" "turns modes 1" "unordered modes unordered" "local modes local"; do set -- $b; bench t4096-$1-r$r $2 $3 4096; done
done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
