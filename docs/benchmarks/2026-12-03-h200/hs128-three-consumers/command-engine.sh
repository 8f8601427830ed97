#!/usr/bin/env bash
# Inside the engine: a trial build (`kiln-hs128c3`) whose head-size-128 persistent forward has
# three consumer warpgroups (192-query work tiles, 64-key tiles, three stages) against the
# kept build (`kiln-c3`: two consumers, 128-key tiles, two stages): the trial's attention
# forward checks, then `kiln bench kernels` at B 4, 16 heads of 128, the builds alternating,
# two rounds at T 4096 and one at 1024 and 8192. Run from the repository root with both
# binaries in gpubin/.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
for b in c3 hs128c3; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
timeout 150 /tmp/kiln-hs128c3 selftest --only kernels --match attention_forward > $R/selftest-hs128c3.log 2>&1
echo "selftest rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-hs128c3.log)"; grep FAIL $R/selftest-hs128c3.log | head
bench() {  # tag, build, seq
  timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq $3 --rows $((4 * $3)) --channels 2048 --heads 16 --no-python --reps 10 --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) $(grep -E '^attention_forward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ')"
}
for round in 1 2; do for b in c3 hs128c3; do bench t4096-$b-r$round $b 4096; done; done
for seq in 1024 8192; do for b in c3 hs128c3; do bench t$seq-$b $b $seq; done; done
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
