#!/usr/bin/env bash
# After dK/dV's 64-row tiles at head size 128 (../dkv-64-rows/): that build (gpubin/kiln-dkv64.xz)
# beside SDPA (replayed from CUDA graphs) at head size 128, B 4, T 1024, 4096 and 8192, one
# `kiln bench kernels` command each; Nsight Compute's view of the new dK/dV kernel and of dQ
# (bench/wgmma_attention/ncu_engine.sh, bf16, T 4096); and whether f16's backward kernels are
# slower than bf16's in cycles or in clock rate: every launch of the head-size-64 dQ and dK/dV
# kernels in both types (B 4, T 4096, 12 heads) with their duration, elapsed SM cycles and SM
# clock, under Nsight Compute's base-clock control and with clocks left free.
# Run from the repository root on the GPU machine.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
xz -dc gpubin/kiln-dkv64.xz > /tmp/kiln && chmod +x /tmp/kiln
for t in 1024 4096 8192; do
  timeout 100 /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq $t --rows $((4 * t)) --channels 2048 --heads 16 --reps 10 --out $R/sdpa-t$t > $R/sdpa-t$t.log 2>&1
  echo "sdpa t$t rc $? t=$(( $(date +%s)-s ))"
  grep -hE "^attention_(forward|backward|forward\+backward) +(bf16|f16) +B4.*x$" $R/sdpa-t$t.log
done
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for cc in base none; do
  timeout 150 "$NCU" -k "regex:attention_backward_(dq|dkv)_(bf16|f16)_hs64_wgmma_tma" -c 60 --clock-control $cc --csv --print-units base \
    --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum \
    --log-file $R/clocks-$cc.csv /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq 4096 --rows 16384 \
    --channels 768 --heads 12 --reps 3 --no-python --out $R/clocks-bench-$cc > $R/clocks-$cc.err 2>&1
  echo "clocks $cc rc $? t=$(( $(date +%s)-s ))"
  python3 - "$R/clocks-$cc.csv" <<'PY'
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; k, m, v = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value")
got = {}
for r in rows[1:]:
    got.setdefault((r[k], r[m]), []).append(float(r[v].replace(",", "")))
for name in sorted({a for a, _ in got}):
    med = {mm: statistics.median(x) for (a, mm), x in got.items() if a == name}
    n = len(got[(name, "gpu__time_duration.sum")])
    print(f"{name:44s} n={n:2d} time {med['gpu__time_duration.sum']/1e3:8.1f} us  cycles {med['sm__cycles_elapsed.avg']/1e3:8.1f} k"
          f"  clock {med['sm__cycles_elapsed.avg.per_second']/1e9:5.3f} GHz  inst {med['smsp__inst_executed.sum']/1e6:7.2f} M")
PY
done
OUT=$R SHAPE="--dtypes bf16 --seq 4096 --rows 16384 --channels 2048 --heads 16" timeout 240 \
  bash bench/wgmma_attention/ncu_engine.sh /tmp/kiln attention_backward_dkv_bf16_hs128 attention_backward_dq_bf16_hs128 > $R/ncu-run.log 2>&1
echo "ncu_engine rc $? t=$(( $(date +%s)-s ))"; grep -E "^==|Duration|Issue Slots|No Eligible|Registers Per|Achieved Occ" $R/ncu-run.log | head -20
rm -rf $R/*/*.png $R/*/results.json $R/clocks-bench-*
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
