#!/usr/bin/env bash
# The head-size-128 dK/dV streaming 64-row tiles in its TMA form (`dkv64`, the build of the
# commit that keeps it: fb35452 with ../hs128-backward-ncu/dkv-64-rows-trial.diff) against the
# build before it (`kept`, fb35452), both built on the development machine as
#   cargo build --release && strip -o /tmp/k target/release/kiln && xz -T2 -9 -c /tmp/k > gpubin/kiln-NAME.xz
# Run on the GPU machine from the repository root: the new build's attention backward checks,
# `kiln bench kernels` alternating the builds at head size 128 (16 heads), B 4, T 1024, 4096
# (two rounds) and 8192, and the new build beside SDPA at T 4096 in one command.
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
