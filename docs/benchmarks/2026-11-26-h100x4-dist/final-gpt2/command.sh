set -u
mkdir -p bin && cp target/release/kiln bin/kiln   # the release build measured; OUT is the log folder
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
O=$OUT
nvidia-smi -L > $O/device.txt; nvidia-smi topo -m >> $O/device.txt 2>&1; nvidia-smi --query-gpu=driver_version --format=csv >> $O/device.txt
cat $O/device.txt | head -5
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=8 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.eval_batches=2 optim.warmup_steps=10 optim.lr=6e-4 optim.min_lr=6e-5 train.steps=50 train.save_final=false"
median() {
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
tr = [r for r in recs if r.get("kind") == "train" and r["step"] > 5]
print(json.dumps({"engine": sys.argv[2], "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in tr)), "peak_gib": round(max(r["mem_peak"] for r in tr) / 2**30, 2)}))
PY
}
s=$(date +%s)
timeout 200 bin/kiln train --profile none -q --out $O/g1 $GPT2 > $O/g1.log 2>&1; echo "g1 rc $? t=$(( $(date +%s)-s ))"; median $O/g1 "kiln 1 GPU" | tee -a $O/summary.jsonl
for N in 2 4; do
  timeout 100 bin/kiln train --profile none -q --gpus $N --out $O/g$N $GPT2 > $O/g$N.log 2>&1; echo "g$N rc $? t=$(( $(date +%s)-s ))"; median $O/g$N "kiln $N GPUs" | tee -a $O/summary.jsonl
done
for Z in 1 2; do
  timeout 100 bin/kiln train --profile none -q --gpus 4 --out $O/g4z$Z $GPT2 dist.zero=$Z > $O/g4z$Z.log 2>&1; echo "g4z$Z rc $? t=$(( $(date +%s)-s ))"; median $O/g4z$Z "kiln 4 GPUs ZeRO-$Z" | tee -a $O/summary.jsonl
done
for N in 1 2 4; do
  timeout 170 torchrun --standalone --nproc-per-node $N bench/pytorch_gpt.py --batch 8 --seq 1024 --modes bf16,bf16-compile --steps 20 --warmup 5 2> $O/torch$N.err | python3 -c "import json,sys; [print(json.dumps({k: v for k, v in json.loads(l).items() if k != 'losses'})) for l in sys.stdin]" | tee -a $O/summary.jsonl
  echo "torch$N t=$(( $(date +%s)-s ))"
done
