set -u
mkdir -p bin && cp target/release/kiln bin/kiln   # the release build of the commit measured; OUT is the log folder
python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[1][1], '/tmp/smol', '.gpufa/tok')" > /dev/null 2>&1 || echo "save failed"
ls /tmp/smol
gzip -dc data/shakespeare.txt.gz > /tmp/shake.txt
S="--profile none train.precision=bf16-mixed train.micro_batch=16 train.seq_len=1024 train.recompute=none train.eval_every=0 train.checkpoint_every=0 train.save_final=false train.log_every=1 optim.warmup_steps=0"
L="lora.rank=16 lora.alpha=32"
timeout 150 bin/kiln finetune -q --init-from /tmp/smol --data /tmp/shake.txt --out $OUT/lora $S $L train.steps=12 > $OUT/lora.log 2>&1; echo "lora rc $?"; tail -n 4 $OUT/lora.log
timeout 150 bin/kiln finetune -q --init-from /tmp/smol --data /tmp/shake.txt --out $OUT/lorat $S $L train.steps=6 --trace $OUT/lora.json --trace-steps 4..=5 > $OUT/lorat.log 2>&1; echo "lora trace rc $?"
timeout 150 bin/kiln train -q --init-from /tmp/smol --out $OUT/full $S train.steps=12 > $OUT/full.log 2>&1; echo "full rc $?"; tail -n 4 $OUT/full.log
timeout 150 bin/kiln train -q --init-from /tmp/smol --out $OUT/fullt $S train.steps=6 --trace $OUT/full.json --trace-steps 4..=5 > $OUT/fullt.log 2>&1; echo "full trace rc $?"
for f in lora full; do python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$OUT/$f/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>3]
print('$f', round(statistics.median(x['tokens_per_s'] for x in t)), 'tok/s; peak', round(max(x['mem_peak'] for x in t)/2**30,2), 'GiB')"; done
python3 bench/trace_ops.py $OUT/lora.json $OUT/full.json
rm -rf $OUT/lora $OUT/lorat $OUT/full $OUT/fullt
