#!/usr/bin/env bash
# f16's dK/dV dS scale folded into dS as it is computed (`kiln-fold`) against the build before
# (`kiln-kept`, which multiplies every dS by the scale when packing it): the changed build's
# attention backward checks, then `kiln bench kernels` alternating the builds, B 4, head size
# 64 (12 heads) and 128 (16 heads); Nsight Compute's durations and instruction counts of the
# backward's kernels in bf16 and f16 at head size 64, T 4096; and the changed build beside
# SDPA once (its bf16 backward row captured on a second attempt where the first fails).
# Run from the repository root with the binaries in gpubin/ (kiln-new.xz is the kept build).
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
xz -dc gpubin/kiln-new.xz > /tmp/kiln-kept; xz -dc gpubin/kiln-fold.xz > /tmp/kiln-fold; chmod +x /tmp/kiln-*
timeout 120 /tmp/kiln-fold selftest --only kernels --match attention_backward > $R/selftest-fold.log 2>&1
echo "selftest fold rc $? t=$(( $(date +%s)-s )) $(grep -E 'checks,' $R/selftest-fold.log)"; grep FAIL $R/selftest-fold.log | head -3
bench() {  # tag, build, seq, head size
  [ $(( $(date +%s)-s )) -gt 330 ] && { echo "$1 skipped (time)"; return; }
  local ch=$(( $4 == 128 ? 2048 : 768 )) nh=$(( $4 == 128 ? 16 : 12 ))
  timeout 60 /tmp/kiln-$2 bench kernels --only compute --dtypes bf16,f16 --seq $3 --rows $((4 * $3)) --channels $ch --heads $nh --reps 10 --no-python --out $R/$1 > $R/$1.log 2>&1
  echo "$1 rc $? t=$(( $(date +%s)-s )) fwd $(grep -E '^attention_forward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ') bwd $(grep -E '^attention_backward ' $R/$1.log | head -2 | awk '{print $2, $7}' | paste -sd' ')"
}
for r in 1 2; do for b in kept fold; do bench hs64-t4096-$b-r$r $b 4096 64; done; done
for r in 1 2; do for b in kept fold; do bench hs128-t4096-$b-r$r $b 4096 128; done; done
for b in kept fold; do bench hs64-t1024-$b $b 1024 64; done
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for d in bf16 f16; do
  [ $(( $(date +%s)-s )) -gt 420 ] && { echo "ncu $d skipped (time)"; continue; }
  timeout 60 "$NCU" --clock-control none --cache-control none -k "regex:attention_(backward_d|value_bound_).*_${d}_hs64" -c 3 --csv \
    --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_elapsed.avg.per_second \
    /tmp/kiln-fold bench kernels --only compute --dtypes $d --seq 4096 --rows 16384 --channels 768 --heads 12 --reps 2 --no-python --out $R/ncu-bench > $R/ncu-$d.csv 2>&1
  echo "ncu $d rc $? t=$(( $(date +%s)-s ))"; grep -E '"attention_' $R/ncu-$d.csv | awk -F'","' '{print $5, $(NF-2), $(NF)}' | head -9
done
[ $(( $(date +%s)-s )) -lt 470 ] && { timeout 90 /tmp/kiln-fold bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 --channels 768 --heads 12 --reps 10 --out $R/sdpa-hs64-t4096 > $R/sdpa-hs64-t4096.log 2>&1
  echo "sdpa rc $? t=$(( $(date +%s)-s ))"; grep -hE "^attention_(forward|backward|forward\+backward) +(bf16|f16) +B4.*x$" $R/sdpa-hs64-t4096.log; grep -h "attention_backward.*bf16" $R/sdpa-hs64-t4096/report.md | grep -o "autograd of SDPA[^|]*"; }
rm -rf $R/*/*.png $R/*/results.json $R/ncu-bench
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
