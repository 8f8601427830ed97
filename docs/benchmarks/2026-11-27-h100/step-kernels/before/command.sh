set -u
mkdir -p bin && cp target/release/kiln bin/kiln   # the release build before this change (e4afd69); OUT is the log folder
python3 -c "import sys; sys.path.insert(0,'bench'); import llama_parity as p; p.save(p.configs()[1][1], '/tmp/smol', '.gpufa/tok')" > /dev/null 2>&1 || echo "save failed"
gzip -dc data/shakespeare.txt.gz > /tmp/shake.txt 2>/dev/null || cp ../shared/data/shakespeare.txt /tmp/shake.txt 2>/dev/null
S="--profile none train.precision=bf16-mixed train.micro_batch=16 train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.save_final=false train.log_every=1 optim.warmup_steps=0"
L="lora.rank=16 lora.alpha=32"
timeout 150 bin/kiln train -q --init-from /tmp/smol --out /tmp/fullt $S train.steps=6 --trace $OUT/full.json --trace-steps 4..=5 > $OUT/fullt.log 2>&1; echo "full trace rc $?"
timeout 150 bin/kiln finetune -q --init-from /tmp/smol --data /tmp/shake.txt --out /tmp/lorat $S $L train.steps=6 --trace $OUT/lora.json --trace-steps 4..=5 > $OUT/lorat.log 2>&1; echo "lora trace rc $?"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=8 train.eval_every=0 train.checkpoint_every=0 train.save_final=false train.log_every=1"
timeout 150 bin/kiln train -q --profile none --device cuda --out /tmp/g2 $GPT2 train.steps=6 --trace $OUT/gpt2.json --trace-steps 4..=5 > $OUT/gpt2.log 2>&1; echo "gpt2 trace rc $?"
for f in full lora gpt2; do python3 bench/trace_ops.py $OUT/$f.json > $OUT/$f.ops.txt; cat $OUT/$f.ops.txt; done
gzip $OUT/*.json
