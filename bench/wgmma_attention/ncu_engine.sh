#!/bin/bash
# Nsight Compute's view of the engine's own attention kernels as `kiln bench kernels` launches
# them (NVRTC-compiled, the engine's launch and tensor maps): for each kernel-name pattern,
# the third matching launch (two warm-up calls before it) with issue, stall, occupancy and
# memory sections, then its warp-stall reasons and pipe utilisations (ncu_stalls.py), and the
# L2 and DRAM traffic it moved. Default: head size 128's dQ and dK/dV backward kernels and its
# forward, bf16, B 4, T 4096. Run from the repository root on a Hopper GPU:
#   bash bench/wgmma_attention/ncu_engine.sh KILN [PATTERN ...]
#   (patterns are regular expressions over kernel names, e.g. attention_backward_dkv_f16_hs64)
set -o pipefail
dir=$(dirname "$0")
out=${OUT:-/tmp}
KILN=${1:?usage: $0 KILN [PATTERN ...]}
shift
pats=("$@")
[ ${#pats[@]} -eq 0 ] && pats=(attention_backward_dq_bf16_hs128 attention_backward_dkv_bf16_hs128 attention_forward_bf16_hs128)
SHAPE=${SHAPE:---dtypes bf16,f16 --seq 4096 --rows 16384 --channels 2048 --heads 16}
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for p in "${pats[@]}"; do
    tag=$(echo "$p" | tr -c 'A-Za-z0-9_\n' '_')
    # shellcheck disable=SC2086
    "$NCU" -k "regex:$p" -s 2 -c 1 --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \
        --metrics lts__t_bytes.sum,dram__bytes.sum,lts__t_sectors_srcunit_tex_op_read.sum \
        "$KILN" bench kernels --only compute $SHAPE --no-python --out "$out/ncu-bench-$tag" > "$out/ncu-$tag.txt" 2>&1
    echo "== $p (ncu rc $?)"
    grep -E "attention_|Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|L2 Cache Thr|DRAM Thr|Memory Thr|Compute \(SM\) Thr|Registers Per|Achieved Occ|Block Limit|lts__t_bytes|dram__bytes|lts__t_sectors" \
        "$out/ncu-$tag.txt" | grep -vE "^attention_(forward|backward)[+ ]" | head -30
    # shellcheck disable=SC2086
    "$NCU" -k "regex:$p" -s 2 -c 1 --csv \
        --metrics "gpu__time_duration.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active,regex:sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*.avg.pct_of_peak_sustained_active" \
        --log-file "$out/ncu-$tag.csv" \
        "$KILN" bench kernels --only compute $SHAPE --no-python --out "$out/ncu-bench-$tag" > "$out/ncu-$tag.err" 2>&1
    echo "-- $p stalls and pipes (ncu rc $?)"
    python3 "$dir/ncu_stalls.py" "$out/ncu-$tag.csv"
done
rm -rf "$out"/ncu-bench-*
