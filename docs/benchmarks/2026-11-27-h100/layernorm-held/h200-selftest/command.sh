set -u
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln && chmod +x bin/kiln
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 230 bin/kiln selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
echo "pass $(grep -c 'PASS$' $OUT/selftest.log) fail $(grep -c 'FAIL' $OUT/selftest.log)"; grep "FAIL" $OUT/selftest.log | head -20; grep -E "^(residual_)?(rms|layer)norm_forward|^linear_gelu|^linear_backward" $OUT/selftest.log | head -40
