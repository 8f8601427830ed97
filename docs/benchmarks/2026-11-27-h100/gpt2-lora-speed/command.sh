#!/usr/bin/env bash
# GPT-2 small (random weights, transformers' GPT2LMHeadModel), LoRA rank 16 on c_attn/c_proj/c_fc,
# bf16, 16 x 1024: kiln LoRA, kiln QLoRA, transformers + PEFT LoRA, one after another in one command.
set -u
O=$OUT
gunzip -c gpubin/kiln-new.gz > /tmp/kiln; chmod +x /tmp/kiln
K=/tmp/kiln
zcat data/shakespeare.txt.gz > /tmp/corpus.txt
$K train -q --device cpu --out /tmp/tokrun model.d_model=32 model.n_layers=1 model.n_heads=2 model.context=32 train.seq_len=32 train.steps=1 train.eval_every=0 data.tokenizer=gpt2 > /dev/null 2>&1
$K export --run /tmp/tokrun --to /tmp/tokhf | tail -1
mkdir -p /tmp/tok && cp /tmp/tokhf/tokenizer*.json /tmp/tok/
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p, transformers as tf
p.save(tf.GPT2Config(), '/tmp/gpt2s', '/tmp/tok')" > $O/save.txt 2>&1 || tail -3 $O/save.txt
med() {
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
tr = [r for r in recs if r.get("kind") == "train" and r["step"] > 10]
print(json.dumps({"engine": sys.argv[2], "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in tr)),
                  "peak_gib": round(max(r["mem_peak"] for r in tr) / 2**30, 2),
                  "first_loss": recs[0].get("loss"), "last_loss": [r["loss"] for r in tr][-1]}))
PY
}
common="train.precision=bf16-mixed train.seq_len=1024 train.micro_batch=16 train.steps=40 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5"
for q in lora qlora; do
  extra=""; [ $q = qlora ] && extra="--qlora"
  rm -rf /tmp/k-$q
  $K finetune --init-from /tmp/gpt2s --data /tmp/corpus.txt --out /tmp/k-$q --device cuda -q $extra $common > $O/kiln-$q.txt 2>&1 \
    || { echo "kiln $q failed"; tail -5 $O/kiln-$q.txt; continue; }
  grep -E "low-rank|QLoRA:" $O/kiln-$q.txt
  med /tmp/k-$q "kiln $q r16 (bf16-mixed)" | tee -a $O/results.jsonl
done
python3 bench/hf_llama_train.py --shape gpt2-small --batch 16 --seq 1024 --lora 16 --steps 15 --warmup 5 2>$O/peft.err | tee -a $O/results.jsonl | cut -c1-300
tail -2 $O/peft.err
