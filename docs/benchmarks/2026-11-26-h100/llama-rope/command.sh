set -u
mkdir -p bin && cp target/release/kiln bin/kiln   # the release build of the commit measured; OUT is the log folder
s=$(date +%s)
timeout 240 bin/kiln selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"; grep -E "rope|failed" $OUT/selftest.log | tail -26
python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[1][1], '/tmp/smol', '.gpufa/tok')" > /dev/null 2>&1 || echo "save failed"
gzip -dc data/shakespeare.txt.gz > /tmp/shake.txt
S="--profile none train.precision=bf16-mixed train.micro_batch=16 train.seq_len=1024 train.recompute=none train.eval_every=0 train.checkpoint_every=0 train.save_final=false train.log_every=1 optim.warmup_steps=0"
timeout 150 bin/kiln finetune -q --init-from /tmp/smol --data /tmp/shake.txt --out $OUT/lora $S lora.rank=16 lora.alpha=32 train.steps=12 > $OUT/lora.log 2>&1; echo "lora rc $?"
timeout 150 bin/kiln train -q --init-from /tmp/smol --out $OUT/full $S train.steps=12 > $OUT/full.log 2>&1; echo "full rc $?"
for f in lora full; do python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$OUT/$f/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>3]
print('$f', round(statistics.median(x['tokens_per_s'] for x in t)), 'tok/s; peak', round(max(x['mem_peak'] for x in t)/2**30,2), 'GiB')"; done
timeout 150 bin/kiln train -q --init-from /tmp/smol --out $OUT/fullt $S train.steps=6 --trace $OUT/full.json --trace-steps 4..=5 > $OUT/fullt.log 2>&1; echo "full trace rc $? t=$(( $(date +%s)-s ))"
python3 bench/trace_ops.py $OUT/full.json
timeout 200 ncu --clock-control none -k "regex:rmsnorm|accumulate_partials|rope_expand" -c 12 --metrics gpu__time_duration.sum,dram__bytes.sum bin/kiln train -q --init-from /tmp/smol --out $OUT/ncu $S train.steps=2 > $OUT/ncu.log 2>&1; echo "ncu rc $? t=$(( $(date +%s)-s ))"
grep -E "^\s+[a-z_]+.*\(|gpu__time_duration|dram__bytes" $OUT/ncu.log | head -60
rm -rf $OUT/lora $OUT/full $OUT/fullt $OUT/ncu $OUT/full.json
