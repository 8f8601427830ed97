#!/usr/bin/env bash
# Prepared, not yet run: the head-size-128 dK/dV streaming 64-row tiles in its TMA form
# (`dkv-64-rows-trial.diff`) against the build without it. Build both on the development
# machine first, from the repository root:
#   cargo build --release && strip -o /tmp/k target/release/kiln && xz -T2 -9 -c /tmp/k > gpubin/kiln-kept.xz
#   git apply docs/benchmarks/2026-12-03-h200/hs128-backward-ncu/dkv-64-rows-trial.diff
#   cargo build --release && strip -o /tmp/k target/release/kiln && xz -T2 -9 -c /tmp/k > gpubin/kiln-dkv64.xz
#   git checkout src/
# Then on the GPU machine, from the repository root: the trial build's attention backward
# checks, `kiln bench kernels` alternating the builds at head size 128 (16 heads), B 4, T
# 1024, 4096 and 8192, and the trial beside SDPA at T 4096.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in kept dkv64; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
timeout 120 /tmp/kiln-dkv64 selftest --only kernels --match attention_backward > $R/selftest-dkv64.log 2>&1
echo "selftest dkv64 rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-dkv64.log)"; grep FAIL $R/selftest-dkv64.log | head -3
bench() {  # tag, build, seq
  [ $(( $(date +%s)-s )) -gt 420 ] && { echo "$1 skipped (time)"; return; }
  timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq $3 --rows $((4 * $3)) --channels 2048 --heads 16 --reps 10 --no-python --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) bwd $(grep -E '^attention_backward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ')"
}
for r in 1 2; do for b in kept dkv64; do bench t4096-$b-r$r $b 4096; done; done
for t in 1024 8192; do for b in kept dkv64; do bench t$t-$b $b $t; done; done
timeout 90 /tmp/kiln-dkv64 bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 --channels 2048 --heads 16 --reps 10 --out $R/sdpa-t4096 > $R/sdpa-t4096.log 2>&1
echo "sdpa rc $? t=$(( $(date +%s)-s ))"; grep -hE "^attention_(forward|backward|forward\+backward) +(bf16|f16) +B4.*x$" $R/sdpa-t4096.log
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
