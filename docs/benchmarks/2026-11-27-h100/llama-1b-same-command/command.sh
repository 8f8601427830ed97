set -u
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln && chmod +x bin/kiln
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/device.txt 2>&1
W=/tmp/w; mkdir -p $W
python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[0][1], '$W/l1b', '.gpufa/tok')" > /dev/null 2>&1 || echo "save failed"
median() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print(json.dumps({'engine':'kiln','shape':'$2','tokens_per_s':round(statistics.median(x['tokens_per_s'] for x in t)),'peak_gib':round(max(x['mem_peak'] for x in t)/2**30,2)}))"; }
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=5 optim.warmup_steps=5 train.save_final=false"
timeout 120 bin/kiln train --init-from $W/l1b --device cuda --out $W/k1b -q $common train.micro_batch=8 train.steps=25 > $OUT/k1b.log 2>&1; median $W/k1b llama-3.2-1b | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"
timeout 300 python3 bench/hf_llama_train.py --shape llama-3.2-1b --batch 8 --seq 1024 --compile 2> $OUT/hf1bc.err | tail -1 | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d.pop('losses',None); print(json.dumps(d))" | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"; tail -3 $OUT/hf1bc.err
