set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln-new && gzip -dc gpubin/kiln-base.gz > bin/kiln-base && chmod +x bin/kiln-new bin/kiln-base
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
# 1. every kernel against the CPU (the Hopper backward included)
timeout 230 bin/kiln-new selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
echo "pass $(grep -c 'PASS$' $OUT/selftest.log) fail $(grep -c 'FAIL' $OUT/selftest.log)"; grep "FAIL" $OUT/selftest.log | head -20
grep -E "^attention_backward" $OUT/selftest.log | head -24
# 2. attention: mma.sync backward (base) and the Hopper backward (new), SDPA beside the new
for hs in 64 128; do
  a=""; [ $hs = 128 ] && a="--channels 2048 --heads 16"
  echo "== head size $hs, base binary"; timeout 100 bin/kiln-base bench kernels --only compute --rows 8192 --dtypes bf16,f16 --no-python $a --out /tmp/kb$hs 2>&1 | grep "^attention" | head -6
  echo "== head size $hs, new binary with SDPA"; timeout 150 bin/kiln-new bench kernels --only compute --rows 8192 --dtypes bf16,f16 $a --out $OUT/k$hs > $OUT/kernels-hs$hs.log 2>&1; grep -E "attention.*x$" $OUT/kernels-hs$hs.log
  echo "t=$(( $(date +%s)-s ))"
done
# 3. dtype order (f16 first), new binary, no PyTorch
echo "== order f16,bf16 (hs 64)"; timeout 100 bin/kiln-new bench kernels --only compute --rows 8192 --dtypes f16,bf16 --no-python --out /tmp/ko 2>&1 | grep "^attention" | head -6
echo "t=$(( $(date +%s)-s ))"
