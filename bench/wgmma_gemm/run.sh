#!/bin/bash
# Builds the fused-epilogue product harness for sm_90a and runs it: every configuration checked
# against a CPU reference and cuBLASLt, then timed beside cuBLASLt's best candidate. Run from
# the repository root on a Hopper GPU: bash bench/wgmma_gemm/run.sh
# Exits non-zero when the build fails or a check exceeds its bound.
set -o pipefail
dir=$(dirname "$0")
out=${OUT:-/tmp}
libcuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
cuda=$(dirname "$(dirname "$(which nvcc)")")
if [ -n "$libcuda" ]; then link=(-Xlinker "$libcuda"); else link=(-L"$cuda/lib64/stubs" -lcuda); fi
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/wgmma_gemm "$dir/harness.cu" \
    -lcublasLt "${link[@]}" 2>"$out/ptxas.txt" || { cat "$out/ptxas.txt"; exit 1; }
grep -E "Compiling entry|registers|spill" "$out/ptxas.txt" | grep -B1 -A1 gemm_ | head -60
grep -iE "C7520|C7512" "$out/ptxas.txt" && echo "WARNING: ptxas serialized wgmma"
/tmp/wgmma_gemm 2>&1 | tee "$out/harness.txt"
