#!/usr/bin/env bash
# Fine-tuning on one GPU, in one command: PEFT loads kiln's adapters (bench/peft_parity.py),
# then kiln LoRA beside transformers + PEFT LoRA (rank 16 on q/k/v/o/gate/up/down, bf16) at
# the SmolLM2-135M shape (16 x 1024) and the Llama-3.2-1B shape (8 x 1024), random weights.
#
#   KILN=target/release/kiln bench/finetune_gpu_check.sh TOKENIZER_DIR
# TOKENIZER_DIR holds SmolLM2's tokenizer.json and tokenizer_config.json (chat template).
set -euo pipefail
K=${KILN:-target/release/kiln} TOK=$1 W=${WORK:-/tmp/kiln-finetune}
mkdir -p "$W"
median() {
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
tr = [r for r in recs if r.get("kind") == "train" and r["step"] > 10]
print(json.dumps({"engine": "kiln LoRA r16", "shape": sys.argv[2],
                  "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in tr)),
                  "peak_gib": round(max(r["mem_peak"] for r in tr) / 2**30, 2)}))
PY
}
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[1][1], '$W/smol', '$TOK')" >/dev/null 2>&1
zcat data/shakespeare.txt.gz > "$W/corpus.txt"
python3 bench/shakespeare_chat.py "$W/corpus.txt" "$W/chat.jsonl" 2000
rm -rf "$W/ft" "$W/merged"
"$K" finetune --init-from "$W/smol" --data "$W/chat.jsonl" --out "$W/ft" --device cuda -q \
  train.precision=fp32 train.seq_len=256 train.micro_batch=8 train.steps=30 \
  train.eval_every=0 optim.lr=5e-3 optim.warmup_steps=2 | tail -3
"$K" export --run "$W/ft" --to "$W/merged" 2>&1 | tail -1
python3 -c "
import json
for p in ['The king is dead', 'What say you, my lord?']:
    print(json.dumps({'prompt': p}))" > "$W/prompts.jsonl"
"$K" generate --run "$W/ft" --prompts "$W/prompts.jsonl" --out "$W/replies.jsonl" \
  --temperature 0 --tokens 32 --precision fp32 2>&1 | tail -1
python3 bench/peft_parity.py --base "$W/smol" --run "$W/ft" --merged "$W/merged" \
  --replies "$W/replies.jsonl"
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=5 optim.warmup_steps=5"
rm -rf "$W/k135"
"$K" finetune --init-from "$W/smol" --data "$W/corpus.txt" --device cuda --out "$W/k135" -q \
  $common train.micro_batch=16 train.steps=40 | tail -2
median "$W/k135" smollm2-135m
python3 bench/hf_llama_train.py --shape smollm2-135m --batch 16 --seq 1024 --lora 16
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[0][1], '$W/l1b', '$TOK')" >/dev/null 2>&1
rm -rf "$W/k1b"
"$K" finetune --init-from "$W/l1b" --data "$W/corpus.txt" --device cuda --out "$W/k1b" -q \
  $common train.micro_batch=8 train.steps=25 | tail -2
median "$W/k1b" llama-3.2-1b
python3 bench/hf_llama_train.py --shape llama-3.2-1b --batch 8 --seq 1024 --steps 10 --warmup 3 --lora 16
