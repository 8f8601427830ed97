set -u
mkdir -p bin && cp target/release/kiln bin/kiln   # the release build of the commit measured; OUT is the log folder
s=$(date +%s)
timeout 240 bin/kiln selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"; grep -E "failed" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head; grep -E "rmsnorm" $OUT/selftest.log | grep 8192 | head -3
W=/tmp/w; mkdir -p $W
python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[1][1], '$W/smol', '.gpufa/tok')" > /dev/null 2>&1 || echo "save failed"
S="--profile none train.precision=bf16-mixed train.micro_batch=16 train.seq_len=1024 train.recompute=none train.eval_every=0 train.checkpoint_every=0 train.save_final=false train.log_every=1 optim.warmup_steps=0"
timeout 100 ncu --clock-control none -k "regex:rmsnorm" -c 4 --metrics gpu__time_duration.sum,dram__bytes.sum bin/kiln train -q --init-from $W/smol --out $W/ncu $S train.steps=1 > $OUT/ncu.log 2>&1; echo "ncu rc $? t=$(( $(date +%s)-s ))"
grep -E "^\s+[a-z_]+.*\(|gpu__time_duration" $OUT/ncu.log | head -12
median() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>10]
print(json.dumps({'engine':'kiln','shape':'$2','tokens_per_s':round(statistics.median(x['tokens_per_s'] for x in t)),'peak_gib':round(max(x['mem_peak'] for x in t)/2**30,2)}))"; }
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=5 optim.warmup_steps=5 train.save_final=false"
timeout 120 bin/kiln train --init-from $W/smol --device cuda --out $W/k135 -q $common train.micro_batch=16 train.steps=40 > $OUT/k135.log 2>&1; median $W/k135 smollm2-135m | tee -a $OUT/speed.jsonl
echo "t=$(( $(date +%s)-s ))"
timeout 230 bin/kiln bench finetune --out $OUT/ft135 > $OUT/ft135.log 2>&1; echo "ft135 rc $? t=$(( $(date +%s)-s ))"; grep -E "tokens/s|target" $OUT/ft135.log | tail -7
timeout 260 bin/kiln bench finetune --shape llama-3.2-1b --out $OUT/ft1b > $OUT/ft1b.log 2>&1; echo "ft1b rc $? t=$(( $(date +%s)-s ))"; grep -E "tokens/s|target" $OUT/ft1b.log | tail -7
