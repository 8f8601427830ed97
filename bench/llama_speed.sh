#!/usr/bin/env bash
# Training throughput of kiln beside transformers (bench/hf_llama_train.py) in one command on
# one GPU, at the SmolLM2-135M shape (16 x 1024, eager and torch.compile) and the
# Llama-3.2-1B shape (8 x 1024, eager), bf16, random weights; then kiln's generation speed
# (64 prompts x 128 new tokens, temperature 0.9, top-p 0.9). kiln's tokens/s is the median of
# metrics.jsonl after step 10.
#
#   bench/llama_speed.sh KILN TOKENIZER_DIR
# TOKENIZER_DIR holds a tokenizer.json (any, e.g. `kiln export` of a run on SmolLM2's GGUF).
set -euo pipefail
K=$1 TOK=$2 W=${WORK:-/tmp/kiln-llama-speed}
mkdir -p "$W"
median() {
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
tr = [r for r in recs if r.get("kind") == "train" and r["step"] > 10]
print(json.dumps({"engine": "kiln", "shape": sys.argv[2],
                  "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in tr)),
                  "peak_gib": round(max(r["mem_peak"] for r in tr) / 2**30, 2)}))
PY
}
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[1][1], '$W/smol', '$TOK')" >/dev/null 2>&1
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=5 optim.warmup_steps=5"
rm -rf "$W/k135" "$W/k1b"
"$K" train --init-from "$W/smol" --device cuda --out "$W/k135" -q $common train.micro_batch=16 train.steps=40 | tail -1
median "$W/k135" smollm2-135m
python3 bench/hf_llama_train.py --shape smollm2-135m --batch 16 --seq 1024
python3 bench/hf_llama_train.py --shape smollm2-135m --batch 16 --seq 1024 --compile 2>&1 | tail -1
"$K" train --device cuda --out "$W/k1b" -q $common model.kind=llama model.d_model=2048 \
  model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.ffn_hidden=8192 model.vocab=128256 \
  model.context=1024 model.rope_theta=500000 data.tokenizer="$TOK/tokenizer.json" \
  train.micro_batch=8 train.steps=25 | tail -1
median "$W/k1b" llama-3.2-1b
python3 bench/hf_llama_train.py --shape llama-3.2-1b --batch 8 --seq 1024 --steps 10 --warmup 3
python3 -c "
import json
for i in range(64):
    print(json.dumps({'prompt': ' '.join(['the history of the city number %d begins' % i] * 8)}))" > "$W/prompts.jsonl"
for k in 0 40; do
  "$K" generate --init-from "$W/smol" --prompts "$W/prompts.jsonl" --out "$W/replies.jsonl" \
    --tokens 128 --temperature 0.9 --top-p 0.9 --top-k $k 2>&1 | tail -1
done
