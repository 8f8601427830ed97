#!/usr/bin/env bash
# f16 backward scales at less work (tc_fit_ds_scales, P's scale in the exponent, paired lse/d
# reads): selftest, attention old/new at head sizes 64 and 128, ncu of the hs128 forward and
# dK/dV kernels.
set -u
for b in before after; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
s=$(date +%s)
timeout 200 /tmp/kiln-after selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
for hs in 64 128; do
  a=""; [ $hs = 128 ] && a="--channels 2048 --heads 16"
  for T in 1024 4096; do
    rows=$(( T * 8 )); [ $T = 4096 ] && rows=16384
    for b in before after; do
      timeout 140 /tmp/kiln-$b bench kernels --only compute --rows $rows --seq $T --dtypes bf16,f16 --vocab 1024 $a --out $OUT/k-$b-$hs-$T > $OUT/kernels-$b-hs$hs-T$T.log 2>&1
      echo "== $b head size $hs, T $T (rc $?, t=$(( $(date +%s)-s )))"; grep -E "^attention.*x$" $OUT/kernels-$b-hs$hs-T$T.log
    done
  done
done
rm -rf $OUT/k-*
NCU=$(which ncu)
for k in attention_forward_bf16_hs128_wgmma attention_backward_dkv_bf16_hs128_wgmma attention_forward_bf16_hs64_wgmma; do
  a=""; case $k in *hs128*) a="--channels 2048 --heads 16";; esac
  timeout 150 $NCU --target-processes all -k regex:$k -s 3 -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats \
    /tmp/kiln-after bench kernels --only compute --rows 16384 --seq 4096 --dtypes bf16 --vocab 1024 $a --out $OUT/k-ncu > $OUT/ncu-$k.log 2>&1
  echo "== ncu $k rc $? t=$(( $(date +%s)-s ))"
  grep -E "Duration|Issue Slots Busy|Issued Ipc|Executed Ipc A|No Eligible|Stall|Compute \(SM\) Thr|Memory Thr|L2 Cache Thr|Registers Per|Achieved Occ|Block Limit|Warp Cycles Per Issued|One or More" $OUT/ncu-$k.log | head -40
done
rm -rf $OUT/k-*
echo "t=$(( $(date +%s)-s ))"
