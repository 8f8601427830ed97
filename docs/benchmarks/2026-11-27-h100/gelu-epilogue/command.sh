set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln && chmod +x bin/kiln
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/device.txt 2>&1
timeout 230 bin/kiln selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
echo "pass $(grep -c 'PASS$' $OUT/selftest.log) fail $(grep -c 'FAIL' $OUT/selftest.log)"; grep "FAIL" $OUT/selftest.log | head -20; grep "^linear_gelu" $OUT/selftest.log
for mb in 8 16; do
  GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=$mb"
  timeout 200 bin/kiln bench train --device cuda --out $OUT/bt$mb $GPT2 > $OUT/bt$mb.log 2>&1; echo "bt$mb rc $? t=$(( $(date +%s)-s ))"; grep -A8 "^## Engines side by side" $OUT/bt$mb/report.md | tail -5
  rm -f $OUT/bt$mb/*.png
done
