#!/usr/bin/env bash
# The persistent forward's blocks given even work (a snake order over the same work tiles)
# against the kept order (every head's same query tile at once): a build with the snake
# (`kiln-snake`) against the kept one (`kiln-kept`), one command: the new build's attention
# forward checks, then `kiln bench kernels` alternating the two builds, B 4, at head size 64
# (12 heads) at T 1024, 4096 (twice) and 8192, and head size 128 (16 heads) at T 4096 and 8192,
# then the new build beside SDPA (replayed from CUDA graphs) at both head sizes, T 4096. Run
# from the repository root with both binaries in gpubin/.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in kept snake; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
timeout 120 /tmp/kiln-snake selftest --only kernels --match attention_forward > $R/selftest-snake.log 2>&1
echo "selftest rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-snake.log)"; grep FAIL $R/selftest-snake.log | head
bench() {  # tag, build, seq, head size, extra
  [ $(( $(date +%s)-s )) -gt 420 ] && { echo "$1 skipped (time)"; return; }
  local ch=$(( $4 == 128 ? 2048 : 768 )) nh=$(( $4 == 128 ? 16 : 12 ))
  timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq $3 --rows $((4 * $3)) --channels $ch --heads $nh --reps 10 $5 --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_forward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ')"
}
for round in 1 2; do for b in kept snake; do bench hs64-t4096-$b-r$round $b 4096 64 --no-python; done; done
for t in 1024 8192; do for b in kept snake; do bench hs64-t$t-$b $b $t 64 --no-python; done; done
for t in 4096 8192; do for b in kept snake; do bench hs128-t$t-$b $b $t 128 --no-python; done; done
bench sdpa-hs64-t4096 snake 4096 64 ""
bench sdpa-hs128-t4096 snake 4096 128 ""
grep -hE "^attention_(forward|backward|forward\+backward) +(bf16|f16) +B4.*x$" $R/sdpa-*.log
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
