#!/usr/bin/env bash
# LoRA and QLoRA over a GPT-2 base on one GPU, in one command from the repository root:
#   1. transformers builds a random GPT2LMHeadModel (4 layers of 256, SmolLM2's tokenizer
#      and its end-of-text id) and saves it; `kiln finetune` trains rank-8 adapters on every projection (c_attn,
#      c_proj, c_fc) in fp32; PEFT loads them onto the same base and must give the
#      log-probabilities of kiln's merged export and kiln's greedy tokens
#      (bench/peft_parity.py);
#   2. QLoRA of the same base in bf16-mixed: the loss falls, PEFT loads the adapter, and the
#      merged export (the dequantised NF4 base plus the adapters) loads in transformers.
#
#   KILN=target/release/kiln OUT=/tmp/out bench/gpt2_lora_gpu_check.sh TOKENIZER_DIR
# TOKENIZER_DIR holds SmolLM2's tokenizer.json and tokenizer_config.json (`kiln export
# --init-from` of the GGUF fixture writes them). Prints PASS/FAIL lines; exits 1 if any
# check failed.
set -uo pipefail
K=${KILN:-target/release/kiln}
O=${OUT:-/tmp/kiln-gpt2-lora}
TOK=$1
mkdir -p "$O"
fail=0
bad() { echo "FAIL $*"; fail=1; }
[ -x "$K" ] || { echo "FAIL $K is not an executable kiln binary (set KILN)"; exit 1; }

python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p, transformers as tf
p.save(tf.GPT2Config(vocab_size=49152, n_embd=256, n_layer=4, n_head=4, n_positions=1024,
                     bos_token_id=0, eos_token_id=0), '$O/gpt2', '$TOK')" >"$O/save.txt" 2>&1 || bad "random GPT-2 directory (log $O/save.txt)"
zcat data/shakespeare.txt.gz >"$O/corpus.txt"
python3 bench/shakespeare_chat.py "$O/corpus.txt" "$O/chat.jsonl" 2000 >/dev/null

echo "== 1. LoRA in fp32: PEFT loads kiln's adapters"
rm -rf "$O/ft" "$O/merged"
timeout 120 "$K" finetune --init-from "$O/gpt2" --data "$O/chat.jsonl" --out "$O/ft" \
  --device cuda train.precision=fp32 train.seq_len=256 train.micro_batch=8 train.steps=30 \
  train.eval_every=0 optim.lr=5e-3 optim.warmup_steps=2 lora.rank=8 >"$O/ft.txt" 2>&1 \
  || bad "lora-finetune (log $O/ft.txt)"
grep -E "low-rank|done:|adapters:" "$O/ft.txt"
timeout 60 "$K" export --run "$O/ft" --to "$O/merged" >"$O/export.txt" 2>&1 \
  || bad "lora-export (log $O/export.txt)"
python3 -c "
import json
for p in ['The king is dead', 'What say you, my lord?', 'ROMEO:']:
    print(json.dumps({'prompt': p}))" >"$O/prompts.jsonl"
timeout 60 "$K" generate --run "$O/ft" --prompts "$O/prompts.jsonl" --out "$O/replies.jsonl" \
  --temperature 0 --tokens 32 --precision fp32 --device cuda >"$O/generate.txt" 2>&1 \
  || bad "lora-generate (log $O/generate.txt)"
python3 bench/peft_parity.py --base "$O/gpt2" --run "$O/ft" --merged "$O/merged" \
  --replies "$O/replies.jsonl" | tee "$O/parity.jsonl"
grep -q '"pass": false' "$O/parity.jsonl" && fail=1
[ "$(grep -c '"pass": true' "$O/parity.jsonl")" = 2 ] || bad "peft-parity (see above)"

echo "== 2. QLoRA in bf16-mixed"
rm -rf "$O/qft" "$O/qmerged"
timeout 120 "$K" finetune --init-from "$O/gpt2" --data "$O/chat.jsonl" --out "$O/qft" \
  --device cuda --qlora train.precision=bf16-mixed train.seq_len=256 train.micro_batch=8 \
  train.steps=40 train.eval_every=0 train.log_every=1 optim.lr=5e-3 optim.warmup_steps=2 \
  >"$O/qft.txt" 2>&1 || bad "qlora-finetune (log $O/qft.txt)"
grep -E "QLoRA:|low-rank|done:|adapters:" "$O/qft.txt"
timeout 60 "$K" export --run "$O/qft" --to "$O/qmerged" >"$O/qexport.txt" 2>&1 \
  || bad "qlora-export (log $O/qexport.txt)"
python3 bench/qlora_run_checks.py --base "$O/gpt2" --run "$O/qft" --merged "$O/qmerged" || fail=1
[ $fail = 0 ] && echo "ALL PASS" || echo "SOME FAILED"
exit $fail
