#!/usr/bin/env bash
# The fused backward at head size 128 (dK/dV computing each tile's dQ contribution, summed in
# f32 in a fixed order; KILN_ATTENTION_FUSED_DQ=1) and f16's dQ taking its dO norms from the
# row term's read, against the build before (`kept`, gpubin/kiln-dkv64.xz: c73af29's kernels).
# `new` is this commit's build (gpubin/kiln-fq.xz) without the fused backward, `fused` the same
# binary with it. Builds made on the development machine as
#   cargo build --release && strip -o /tmp/k target/release/kiln && xz -T2 -9 -c /tmp/k > gpubin/kiln-NAME.xz
# Run on the GPU machine from the repository root.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-dkv64.xz > /tmp/kiln-kept && xz -dc gpubin/kiln-fq.xz > /tmp/kiln-new && chmod +x /tmp/kiln-*
check() {  # tag, fused (0/1), match
  KILN_ATTENTION_FUSED_DQ=$2 timeout 150 /tmp/kiln-new selftest --only kernels --match $3 > $R/selftest-$1.log 2>&1
  rc=$?; echo "selftest $1 rc $rc t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-$1.log)"; grep -E "FAIL" $R/selftest-$1.log | head -5
  return $rc
}
FUSED=1  # the fused build's benches run only if its checks passed
check fused-backward 1 attention_backward || FUSED=0
[ $FUSED = 1 ] && { check fused-repeatable 1 attention_repeatable || FUSED=0; }
check new-backward 0 attention_backward
bench() {  # tag, build, fused, seq, channels, heads
  [ $(( $(date +%s)-s )) -gt 470 ] && { echo "$1 skipped (time)"; return; }
  [ $3 = 1 ] && [ $FUSED = 0 ] && { echo "$1 skipped (checks)"; return; }
  KILN_ATTENTION_FUSED_DQ=$3 timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq $4 --rows $((4 * $4)) --channels $5 --heads $6 --reps 10 --no-python --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) bwd $(grep -E '^attention_backward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ')"
}
for r in 1 2; do
  for b in "kept kept 0" "new new 0" "fused new 1"; do set -- $b; bench hs128-t4096-$1-r$r $2 $3 4096 2048 16; done
  for b in "kept kept 0" "new new 0"; do set -- $b; bench hs64-t4096-$1-r$r $2 $3 4096 768 12; done
done
for t in 1024 8192; do for b in "kept kept 0" "fused new 1"; do set -- $b; bench hs128-t$t-$1 $2 $3 $t 2048 16; done; done
if [ $FUSED = 1 ] && [ $(( $(date +%s)-s )) -lt 450 ]; then
  KILN_ATTENTION_FUSED_DQ=1 timeout 90 /tmp/kiln-new bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 --channels 2048 --heads 16 --reps 10 --out $R/sdpa-fused-hs128-t4096 > $R/sdpa-fused-hs128-t4096.log 2>&1
  echo "sdpa rc $? t=$(( $(date +%s)-s ))"; grep -hE "^attention_(forward|backward|forward\+backward) +(bf16|f16) +B4.*x$" $R/sdpa-fused-hs128-t4096.log
fi
rm -f $R/*/*.png $R/*/results.json
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
