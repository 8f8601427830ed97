set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln && chmod +x bin/kiln
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/device.txt 2>&1
W=/tmp/w; mkdir -p $W
python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[1][1], '$W/smol', '.gpufa/tok'); p.save(p.configs()[0][1], '$W/l1b', '.gpufa/tok')" > /dev/null 2>&1 || echo "save failed"
median() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print(json.dumps({'engine':'kiln','shape':'$2','tokens_per_s':round(statistics.median(x['tokens_per_s'] for x in t)),'peak_gib':round(max(x['mem_peak'] for x in t)/2**30,2)}))"; }
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=5 optim.warmup_steps=5 train.save_final=false"
timeout 100 bin/kiln train --init-from $W/smol --device cuda --out $W/k135 -q $common train.micro_batch=16 train.steps=40 > $OUT/k135.log 2>&1; median $W/k135 smollm2-135m | tee -a $OUT/speed.jsonl
timeout 120 bin/kiln train --init-from $W/l1b --device cuda --out $W/k1b -q $common train.micro_batch=8 train.steps=25 > $OUT/k1b.log 2>&1; median $W/k1b llama-3.2-1b | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"
timeout 150 python3 bench/hf_llama_train.py --shape smollm2-135m --batch 16 --seq 1024 --compile 2> $OUT/hf135c.err | tail -1 | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d.pop('losses',None); print(json.dumps(d))" | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"
# Op traces: the SmolLM2 shape and GPT-2 small (bf16-mixed, 8 x 1024)
timeout 100 bin/kiln train -q --init-from $W/smol --device cuda --out $W/t --profile none $common train.micro_batch=16 train.steps=6 --trace $W/t.json --trace-steps 4..=5 > /dev/null 2>&1; python3 bench/trace_ops.py $W/t.json > $OUT/trace_ops_smollm2.txt; head -24 $OUT/trace_ops_smollm2.txt
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=8"
timeout 100 bin/kiln train -q --device cuda --out $W/g --profile none $GPT2 train.eval_every=0 train.checkpoint_every=0 train.save_final=false train.steps=6 --trace $W/g.json --trace-steps 4..=5 > $OUT/gpt2_trace.log 2>&1; python3 bench/trace_ops.py $W/g.json > $OUT/trace_ops_gpt2.txt; head -30 $OUT/trace_ops_gpt2.txt
echo "t=$(( $(date +%s)-s ))"
