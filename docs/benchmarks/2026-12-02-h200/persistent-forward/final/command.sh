#!/usr/bin/env bash
# The kept build (`kiln-final`: the persistent forward at head size 128, dQ's TMA form there):
# attention kernel checks with its defaults and with KILN_ATTENTION_PERSISTENT=0, then
# `kiln bench kernels` beside SDPA at head size 128, B 4, T 1024, 4096 and 8192.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-final.xz > /tmp/kiln && chmod +x /tmp/kiln
M=attention_forward,attention_backward
timeout 150 /tmp/kiln selftest --only kernels --match $M > $R/selftest.log 2>&1
echo "selftest rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest.log)"
KILN_ATTENTION_PERSISTENT=0 timeout 150 /tmp/kiln selftest --only kernels --match $M > $R/selftest-p0.log 2>&1
echo "selftest persistent=0 rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-p0.log)"
for seq in 1024 4096 8192; do
  tag=sdpa-t$seq-c2048
  timeout 150 /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq $seq --rows $((4 * seq)) --channels 2048 --heads 16 --reps 10 --out $R/$tag > $R/$tag.log 2>&1
  echo "$tag rc $? t=$(( $(date +%s)-s ))"
  grep -E "^\| attention" $R/$tag/report.md | awk -F'|' '{print $2,$3,$6,$10,$11}'
done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
