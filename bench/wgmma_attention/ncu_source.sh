#!/bin/bash
# Where one Hopper forward configuration's warps wait, instruction by instruction: Nsight
# Compute's warp-stall sampling of `harness profile NAME` (B 8, T 4096, causal; the sixth
# launch), exported as the SASS source page and summarised by ncu_source.py (the instructions
# with the most stall samples, and the samples by reason and by opcode). Run from the
# repository root on a Hopper GPU:
#   bash bench/wgmma_attention/ncu_source.sh [NAME]   # default: wg_bf16_hs128_n64
set -o pipefail
dir=$(dirname "$0")
out=${OUT:-/tmp}
name=${1:-wg_bf16_hs128_n64}
[ -x /tmp/wgmma_harness ] || nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo \
    -o /tmp/wgmma_harness "$dir/harness.cu" || exit 1
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
"$NCU" -k "regex:^$name\$" -s 5 -c 1 --section SourceCounters --section WarpStateStats -f \
    -o "$out/source-$name" /tmp/wgmma_harness profile "$name" > "$out/source-$name.log" 2>&1
echo "ncu rc $?"
"$NCU" -i "$out/source-$name.ncu-rep" --page source --csv --print-source sass > "$out/source-$name.csv" 2>"$out/source-$name.err"
echo "export rc $? ($(wc -l < "$out/source-$name.csv") lines)"
head -c 600 "$out/source-$name.err"
python3 "$dir/ncu_source.py" "$out/source-$name.csv"
