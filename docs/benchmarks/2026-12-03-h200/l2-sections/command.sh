#!/usr/bin/env bash
# The persistent forward's work tiles in sections of a few heads (their K and V about 24 MiB
# of L2) against the order before (every head's same query tile at once): a build with the
# sections (`kiln-l2`) against the one before (`kiln-c3`), one command: the new build's
# attention forward checks, then `kiln bench kernels` alternating the two builds, B 4, at
# head size 128 (16 heads) and 64 (12 heads), T 4096 twice and 8192 once, and the new build
# beside SDPA (replayed from CUDA graphs) at head size 128, T 4096. Run from the repository
# root with both binaries in gpubin/.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in c3 l2; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
timeout 120 /tmp/kiln-l2 selftest --only kernels --match attention_forward > $R/selftest-l2.log 2>&1
echo "selftest rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-l2.log)"; grep FAIL $R/selftest-l2.log | head
bench() {  # tag, build, seq, head size, extra
  [ $(( $(date +%s)-s )) -gt 330 ] && { echo "$1 skipped (time)"; return; }
  local ch=$(( $4 == 128 ? 2048 : 768 )) nh=$(( $4 == 128 ? 16 : 12 ))
  timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq $3 --rows $((4 * $3)) --channels $ch --heads $nh --reps 10 $5 --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_forward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ')"
}
for round in 1 2; do for b in c3 l2; do bench hs128-t4096-$b-r$round $b 4096 128 --no-python; done; done
for b in c3 l2; do bench hs64-t4096-$b $b 4096 64 --no-python; done
for b in c3 l2; do bench hs128-t8192-$b $b 8192 128 --no-python; done
bench sdpa-hs128-t4096 l2 4096 128 ""
grep -E "^attention_(forward|backward|forward\+backward) +(bf16|f16) +B4.*x$" $R/sdpa-hs128-t4096.log
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
