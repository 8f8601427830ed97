set -u
mkdir -p bin && cp target/release/kiln bin/kiln   # the release build of the commit measured; OUT is the log folder
s=$(date +%s)
timeout 240 bin/kiln selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"; grep -E "matmul_view|failed" $OUT/selftest.log | tail -16
timeout 200 bin/kiln bench finetune --out $OUT/ft135 > $OUT/ft135.log 2>&1; echo "ft135 rc $? t=$(( $(date +%s)-s ))"; grep -E "tokens/s|target" $OUT/ft135.log | tail -8
python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[1][1], '/tmp/smol', '.gpufa/tok')" > /dev/null 2>&1 || echo "save failed"
gzip -dc data/shakespeare.txt.gz > /tmp/shake.txt
S="--profile none train.precision=bf16-mixed train.micro_batch=16 train.seq_len=1024 train.recompute=none train.eval_every=0 train.checkpoint_every=0 train.save_final=false train.log_every=1 optim.warmup_steps=0"
timeout 150 bin/kiln finetune -q --init-from /tmp/smol --data /tmp/shake.txt --out $OUT/lorat $S lora.rank=16 lora.alpha=32 train.steps=6 --trace $OUT/lora.json --trace-steps 4..=5 > $OUT/lorat.log 2>&1; echo "lora trace rc $? t=$(( $(date +%s)-s ))"; tail -2 $OUT/lorat.log
python3 bench/trace_ops.py $OUT/lora.json
rm -rf $OUT/lorat
