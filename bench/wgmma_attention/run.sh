#!/bin/bash
# Builds the harness for sm_90a, checks and times the wgmma forward against the mma.sync one,
# then times PyTorch SDPA at the same shapes. Run from the repository root on a Hopper GPU:
#   bash bench/wgmma_attention/run.sh [quick]
set -o pipefail
dir=$(dirname "$0")
out=${OUT:-/tmp}
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/wgmma_harness \
    "$dir/harness.cu" 2>"$out/ptxas.txt" || { cat "$out/ptxas.txt"; exit 1; }
grep -A2 "entry function 'wg_" "$out/ptxas.txt" | grep -i "registers\|spill" | sort | uniq -c
/tmp/wgmma_harness "$@" 2>&1 | tee "$out/harness.txt"
rc=$?
PYTHONUNBUFFERED=1 python3 "$dir/sdpa.py" 2>&1 | tee "$out/sdpa.txt"
exit $rc
