set -u
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln && chmod +x bin/kiln
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/device.txt 2>&1
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=8"
timeout 260 bin/kiln bench train --device cuda --out $OUT/bt8 $GPT2 > $OUT/bt8.log 2>&1; echo "bt8 rc $?"; grep -A10 "^## Engines side by side" $OUT/bt8/report.md | head -14
echo "t=$(( $(date +%s)-s ))"
W=/tmp/w; mkdir -p $W
python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[1][1], '$W/smol', '.gpufa/tok')" > /dev/null 2>&1 || echo "save failed"
median() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print(json.dumps({'engine':'kiln','shape':'$2','tokens_per_s':round(statistics.median(x['tokens_per_s'] for x in t)),'peak_gib':round(max(x['mem_peak'] for x in t)/2**30,2)}))"; }
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=5 optim.warmup_steps=5 train.save_final=false"
timeout 100 bin/kiln train --init-from $W/smol --device cuda --out $W/k135 -q $common train.micro_batch=16 train.steps=40 > $OUT/k135.log 2>&1; median $W/k135 smollm2-135m | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"
timeout 150 python3 bench/hf_llama_train.py --shape smollm2-135m --batch 16 --seq 1024 --compile 2> $OUT/hf135c.err | tail -1 | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d.pop('losses',None); print(json.dumps(d))" | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"
