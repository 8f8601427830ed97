#!/bin/bash
# Builds the harness for sm_90a, checks every Hopper configuration against the CPU reference
# and times them beside the mma.sync forward, then times PyTorch SDPA at the same shapes and
# prints the times side by side. Run from the repository root on a Hopper GPU:
#   [TMA=1] bash bench/wgmma_attention/run.sh [quick]
# Exits non-zero when the build fails, a configuration spills, or a check exceeds its bound.
set -o pipefail
dir=$(dirname "$0")
out=${OUT:-/tmp}
# TMA=1 adds the configurations fed by the TMA unit (`_tma`), which need the driver's
# cuTensorMapEncodeTiled (libcuda; the toolkit's stub where the driver's has no plain name).
extra=()
if [ "${TMA:-0}" = 1 ]; then
    libcuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
    cuda=$(dirname "$(dirname "$(which nvcc)")")
    if [ -n "$libcuda" ]; then extra=(-DKILN_HARNESS_TMA -Xlinker "$libcuda")
    else extra=(-DKILN_HARNESS_TMA -L"$cuda/lib64/stubs" -lcuda); fi
fi
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v "${extra[@]}" -o /tmp/wgmma_harness \
    "$dir/harness.cu" 2>"$out/ptxas.txt" || { cat "$out/ptxas.txt"; exit 1; }
python3 "$dir/summary.py" ptxas "$out/ptxas.txt"
# wgmma serialized by ptxas (C7520, or C7512 where registers run short) costs most of its
# speed: say so loudly.
grep -iE "C7520|C7512" "$out/ptxas.txt" && echo "WARNING: ptxas serialized wgmma in the functions above"
/tmp/wgmma_harness "$@" 2>&1 | tee "$out/harness.txt"
rc=$?
PYTHONUNBUFFERED=1 python3 "$dir/sdpa.py" 2>&1 | tee "$out/sdpa.txt"
python3 "$dir/summary.py" times "$out/harness.txt" "$out/sdpa.txt" | tee "$out/summary.txt"
echo "harness exit status: $rc"
exit $rc
