#!/usr/bin/env bash
# The persistent forward's work tiles handed out by a counter in global memory (each block
# taking the next tile when it comes free) against the kept snake order: three builds, one
# command: `kiln-kept` (WG_ORDER_SNAKE), `kiln-ctr` (WG_ORDER_COUNTER: the heads' tiles from
# the counter) and `kiln-csec` (WG_ORDER_COUNTER_SECTIONS: tiles in sections of heads whose K
# and V fill about 24 MiB of L2, from the counter). The two trial builds' attention forward
# checks, then `kiln bench kernels` alternating the builds, B 4, head size 128 (16 heads) at T
# 4096 (twice), 8192 and 2048, head size 64 (12 heads) at T 4096, 8192 and 1024, B 8 at head
# size 128, T 4096. Run from the repository root with the binaries in gpubin/.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in kept ctr csec; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
for b in ctr csec; do
  timeout 120 /tmp/kiln-$b selftest --only kernels --match attention_forward > $R/selftest-$b.log 2>&1
  echo "selftest $b rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-$b.log)"; grep FAIL $R/selftest-$b.log | head
done
bench() {  # tag, build, seq, head size, batch
  [ $(( $(date +%s)-s )) -gt 470 ] && { echo "$1 skipped (time)"; return; }
  local ch=$(( $4 == 128 ? 2048 : 768 )) nh=$(( $4 == 128 ? 16 : 12 ))
  timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq $3 --rows $(($5 * $3)) --channels $ch --heads $nh --reps 10 --no-python --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_forward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ')"
}
for round in 1 2; do for b in kept ctr csec; do bench hs128-t4096-$b-r$round $b 4096 128 4; done; done
for b in kept ctr csec; do bench hs128-t8192-$b $b 8192 128 4; done
for b in kept ctr csec; do bench hs64-t4096-$b $b 4096 64 4; done
for b in kept ctr csec; do bench hs128-b8-t4096-$b $b 4096 128 8; done
for b in kept ctr csec; do bench hs64-t8192-$b $b 8192 64 4; done
for b in kept ctr csec; do bench hs128-t2048-$b $b 2048 128 4; done
for b in kept ctr csec; do bench hs64-t1024-$b $b 1024 64 4; done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
