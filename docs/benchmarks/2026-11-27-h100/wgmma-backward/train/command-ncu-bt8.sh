set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln && chmod +x bin/kiln
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/device.txt 2>&1
# 1. Nsight Compute on the three Hopper attention kernels (head size 64 and 128, T 4096, bf16)
for hs in 64 128; do
  a=""; [ $hs = 128 ] && a="--channels 2048 --heads 16"
  timeout 150 ncu -k regex:"attention_(forward|backward_dq|backward_dkv)_bf16_hs${hs}_wgmma" -c 3 --section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section LaunchStats \
    bin/kiln bench kernels --only compute --rows 16384 --seq 4096 --dtypes bf16 --no-python --reps 1 --warmup 0 $a --out /tmp/nk$hs > $OUT/ncu-hs$hs.txt 2>&1
  echo "ncu hs $hs rc $? t=$(( $(date +%s)-s ))"
  grep -E "attention_|Duration|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit (Reg|Shared)|Issue Slots Busy|Warp Cycles Per Issued" $OUT/ncu-hs$hs.txt | head -60
done
# 2. GPT-2 small, bf16-mixed, micro-batch 8: kiln beside PyTorch eager and torch.compile
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=8"
timeout 300 bin/kiln bench train --device cuda --out $OUT/bt8 $GPT2 > $OUT/bt8.log 2>&1; echo "bt8 rc $? t=$(( $(date +%s)-s ))"; grep -A10 "^## Engines side by side" $OUT/bt8/report.md | head -14
rm -f $OUT/bt8/*.png
