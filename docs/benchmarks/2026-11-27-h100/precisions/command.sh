set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln && chmod +x bin/kiln
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/device.txt 2>&1
for p in fp16-mixed tf32 fp32; do
  GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=$p train.micro_batch=8"
  timeout 190 bin/kiln bench train --device cuda --out $OUT/bt-$p $GPT2 > $OUT/bt-$p.log 2>&1; echo "$p rc $? t=$(( $(date +%s)-s ))"; grep -A9 "^## Engines side by side" $OUT/bt-$p/report.md | tail -6
  rm -f $OUT/bt-$p/*.png
done
