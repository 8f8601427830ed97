set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln-new && chmod +x bin/kiln-new
s=$(date +%s)
which nsys ncu 2>&1 | head -2
# Attention with a 200 ms settle before every timed kernel (kiln and PyTorch), SDPA beside it.
for hs in 64 128; do
  a=""; [ $hs = 128 ] && a="--channels 2048 --heads 16"
  for T in 1024 4096; do
    rows=$(( T * 8 )); [ $T = 4096 ] && rows=16384
    timeout 140 bin/kiln-new bench kernels --only compute --rows $rows --seq $T --dtypes bf16,f16 $a --out $OUT/k${hs}_$T > $OUT/kernels-hs${hs}-T$T.log 2>&1
    echo "== head size $hs, T $T (rc $?, t=$(( $(date +%s)-s )))"; grep -E "^attention.*x$" $OUT/kernels-hs${hs}-T$T.log
  done
done
rm -f $OUT/k*/*.png
