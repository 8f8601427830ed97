#!/usr/bin/env bash
# The kept build (dQ streaming 64-key tiles at head size 128) beside SDPA at head size 128,
# T 1024, 4096 and 8192.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
xz -dc gpubin/kiln-dq64.xz > /tmp/kiln && chmod +x /tmp/kiln
for seq in 1024 4096 8192; do
  tag=sdpa-t$seq-c2048
  timeout 150 /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq $seq --rows $((4 * seq)) --channels 2048 --heads 16 --reps 10 --out $R/$tag > $R/$tag.log 2>&1
  echo "$tag rc $? t=$(( $(date +%s)-s ))"
  grep -E "^attention.*x$" $R/$tag.log | head -6
done
rm -f $R/*/*.png
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
