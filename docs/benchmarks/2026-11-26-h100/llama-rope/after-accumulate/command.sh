set -u
mkdir -p bin && cp target/release/kiln bin/kiln   # the release build of the commit measured; OUT is the log folder
s=$(date +%s)
timeout 240 bin/kiln selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"; grep -E "failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
W=/tmp/w; mkdir -p $W
python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[1][1], '$W/smol', '.gpufa/tok')" > /dev/null 2>&1 || echo "save failed"
S="--profile none train.precision=bf16-mixed train.micro_batch=16 train.seq_len=1024 train.recompute=none train.eval_every=0 train.checkpoint_every=0 train.save_final=false train.log_every=1 optim.warmup_steps=0"
timeout 100 ncu --clock-control none -k "regex:rmsnorm_backward|rmsnorm_param|accumulate_partials" -c 6 --metrics gpu__time_duration.sum,dram__bytes.sum bin/kiln train -q --init-from $W/smol --out $W/ncu $S train.steps=1 > $OUT/ncu.log 2>&1; echo "ncu rc $? t=$(( $(date +%s)-s ))"
grep -E "^\s+[a-z_]+.*\(|gpu__time_duration|dram__bytes" $OUT/ncu.log | head -30
median() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print(json.dumps({'engine':'kiln','shape':'$2','tokens_per_s':round(statistics.median(x['tokens_per_s'] for x in t)),'peak_gib':round(max(x['mem_peak'] for x in t)/2**30,2)}))"; }
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=5 optim.warmup_steps=5 train.save_final=false"
timeout 120 bin/kiln train --init-from $W/smol --device cuda --out $W/k135 -q $common train.micro_batch=16 train.steps=40 > $OUT/k135.log 2>&1; median $W/k135 smollm2-135m | tee -a $OUT/speed.jsonl
timeout 200 python3 bench/hf_llama_train.py --shape smollm2-135m --batch 16 --seq 1024 --compile 2> $OUT/hf135c.err | tail -1 | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"
timeout 150 bin/kiln train --device cuda --out $W/k1b -q $common model.kind=llama model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.ffn_hidden=8192 model.vocab=128256 model.context=1024 model.rope_theta=500000 data.tokenizer=.gpufa/tok/tokenizer.json train.micro_batch=8 train.steps=25 > $OUT/k1b.log 2>&1; median $W/k1b llama-3.2-1b | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"
timeout 100 bin/kiln train -q --out $W/def > $OUT/default.log 2>&1; echo "default rc $?"; grep -i "val loss" $OUT/default.log | tail -1
echo "t=$(( $(date +%s)-s ))"
