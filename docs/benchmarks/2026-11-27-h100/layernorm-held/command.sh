set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln && gzip -dc gpubin/kiln-base.gz > bin/kiln-base && chmod +x bin/kiln bin/kiln-base
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/device.txt 2>&1
timeout 230 bin/kiln selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
echo "pass $(grep -c 'PASS$' $OUT/selftest.log) fail $(grep -c 'FAIL' $OUT/selftest.log)"; grep "FAIL" $OUT/selftest.log | head -20; grep "layernorm_forward" $OUT/selftest.log | head -18
# layernorm kernels: the morning's build (base) and this one, same command
for b in kiln-base kiln; do echo "== $b"; timeout 80 bin/$b bench kernels --only memory --rows 8192 --dtypes bf16,f16 --no-python --out /tmp/m$b 2>&1 | grep -E "^(residual_)?layernorm_forward"; done
echo "t=$(( $(date +%s)-s ))"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=8"
timeout 200 bin/kiln bench train --device cuda --out $OUT/bt8 $GPT2 > $OUT/bt8.log 2>&1; echo "bt8 rc $? t=$(( $(date +%s)-s ))"; grep -A8 "^## Engines side by side" $OUT/bt8/report.md | tail -5
rm -f $OUT/bt8/*.png
