#!/usr/bin/env bash
# The persistent forward at head size 64 inside the engine (`kiln-p64`: 128-key tiles, three
# stages, turns) against the kept build (`kiln-final`: the one-warpgroup TMA forward there):
# kernel checks of p64, then `kiln bench kernels` B 4, 12 heads of 64, T 1024 / 4096 / 8192,
# alternating (SDPA in the same command at T 4096).
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
for v in final p64; do xz -dc gpubin/kiln-$v.xz > /tmp/kiln-$v && chmod +x /tmp/kiln-$v; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 /tmp/kiln-p64 selftest --only kernels --match attention_forward,attention_backward > $R/selftest-p64.log 2>&1
echo "selftest p64 rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-p64.log)"
for seq in 1024 4096 8192; do
  for v in final p64; do
    tag=$v-t$seq; py=--no-python; [ $seq = 4096 ] && py=
    timeout 120 /tmp/kiln-$v bench kernels --only compute --dtypes bf16,f16 --seq $seq --rows $((4 * seq)) $py --reps 10 --out $R/$tag > $R/$tag.log 2>&1
    echo "$tag rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_forward ' $R/$tag.log | awk '{print $2, $7}' | paste -sd' ')"
  done
done
grep -h "^| attention_forward " $R/*-t4096/report.md | awk -F'|' '{print $2,$3,$6,$10,$11}'
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
