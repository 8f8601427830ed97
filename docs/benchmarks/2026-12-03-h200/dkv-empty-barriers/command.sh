#!/usr/bin/env bash
# dK/dV's TMA form (two warpgroups a block) releasing each stage through empty barriers, each
# warpgroup copying its own lse and d rows and waiting at a named barrier of its own, instead
# of a block barrier a tile (`release`, gpubin/kiln-dkvrel.xz, the build of `trial.diff` on
# c73177e) against c73177e's kernels (`kept`, gpubin/kiln-dkv64.xz), both built on the
# development machine as
#   cargo build --release && strip -o /tmp/k target/release/kiln && xz -T2 -9 -c /tmp/k > gpubin/kiln-NAME.xz
# Run on the GPU machine from the repository root: the new build's attention backward checks,
# then `kiln bench kernels` alternating the builds, B 4, head size 64 (12 heads) and 128 (16),
# T 4096 twice, T 1024 and 8192 once; then the new build beside SDPA at head size 64, T 4096.
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-dkv64.xz > /tmp/kiln-kept && xz -dc gpubin/kiln-dkvrel.xz > /tmp/kiln-release && chmod +x /tmp/kiln-*
timeout 150 /tmp/kiln-release selftest --only kernels --match attention_backward > $R/selftest-release.log 2>&1
echo "selftest release rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-release.log)"; grep FAIL $R/selftest-release.log | head -3
bench() {  # tag, build, seq, channels, heads
  [ $(( $(date +%s)-s )) -gt 300 ] && { echo "$1 skipped (time)"; return; }
  timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq $3 --rows $((4 * $3)) --channels $4 --heads $5 --reps 10 --no-python --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) bwd $(grep -E '^attention_backward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ')"
}
for r in 1 2; do for b in kept release; do bench hs64-t4096-$b-r$r $b 4096 768 12; bench hs128-t4096-$b-r$r $b 4096 2048 16; done; done
for t in 1024 8192; do for b in kept release; do bench hs64-t$t-$b $b $t 768 12; bench hs128-t$t-$b $b $t 2048 16; done; done
if [ $(( $(date +%s)-s )) -lt 330 ]; then
  timeout 90 /tmp/kiln-release bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 --channels 768 --heads 12 --reps 10 --out $R/sdpa-hs64-t4096 > $R/sdpa-hs64-t4096.log 2>&1
  echo "sdpa rc $? t=$(( $(date +%s)-s ))"; grep -hE "^attention_(forward|backward|forward\+backward) +(bf16|f16) +B4.*x$" $R/sdpa-hs64-t4096.log
fi
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
