#!/usr/bin/env bash
# A real chat fine-tune on one GPU, in one command: SmolLM2-135M-Instruct from its GGUF,
# LoRA rank 16 on every projection, bf16, batch 16 x 256, on 2000 cue/reply chats built from
# the bundled corpus (bench/shakespeare_chat.py; the last 5% held out), for STEPS steps. It
# prints the held-out bits per trained token before and after (the run's own evaluation),
# then two sampled replies (temperature 0.8, top-p 0.9, seed 1) to each of the last three
# held-out cues, in the training chat format (system prompt + cue), from the base and from
# the fine-tuned run.
#
#   KILN=target/release/kiln bench/chat_finetune_gpu_check.sh SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail
K=${KILN:-target/release/kiln} GGUF=$1 W=${WORK:-/tmp/kiln-chat-ft} STEPS=${STEPS:-100}
# DEVICE=cpu PRECISION=fp32 STEPS=2 runs the same on the CPU (slowly), to try the script.
DEVICE=${DEVICE:-cuda} PRECISION=${PRECISION:-bf16}
mkdir -p "$W"
zcat data/shakespeare.txt.gz > "$W/corpus.txt"
python3 bench/shakespeare_chat.py "$W/corpus.txt" "$W/chat.jsonl" 2000
# The last three held-out chats, without their replies, as generation prompts.
python3 - "$W/chat.jsonl" "$W/cues.jsonl" <<'PY'
import json, sys
chats = [json.loads(l) for l in open(sys.argv[1])]
with open(sys.argv[2], "w") as out:
    for c in chats[-3:]:
        out.write(json.dumps({"messages": [m for m in c["messages"] if m["role"] != "assistant"]}) + "\n")
PY
rm -rf "$W/ft"
"$K" finetune --init-from "$GGUF" --data "$W/chat.jsonl" --out "$W/ft" --device "$DEVICE" \
  train.precision=$([ "$PRECISION" = bf16 ] && echo bf16-mixed || echo fp32) train.seq_len=256 train.micro_batch=16 train.steps="$STEPS" \
  train.eval_every=50 train.log_every=50 train.checkpoint_every=0 data.val_fraction=0.05 \
  optim.lr=3e-3 optim.warmup_steps=10 2>&1 | grep -E "val loss|done:"
sample() { # sample LABEL SOURCE-ARGS...
  local label=$1
  shift
  "$K" generate "$@" --chat --prompts "$W/cues.jsonl" --num-samples 2 --tokens 60 \
    --temperature 0.8 --top-p 0.9 --seed 1 --device "$DEVICE" --precision "$PRECISION" \
    --out "$W/$label.jsonl" >/dev/null 2>&1
  python3 - "$W/cues.jsonl" "$W/$label.jsonl" "$label" <<'PY'
import json, sys
cues = [json.loads(l)["messages"][-1]["content"] for l in open(sys.argv[1])]
for line, cue in zip(open(sys.argv[2]), cues):
    r = json.loads(line)
    texts = r.get("samples") or r.get("texts") or r.get("replies") or [r.get("text")]
    print(f"[{sys.argv[3]}] cue: {cue[:160]}")
    for t in texts:
        t = t["text"] if isinstance(t, dict) else t
        print(f"    -> {t.strip()[:300]!r}")
PY
}
sample base --init-from "$GGUF"
sample fine-tuned --run "$W/ft"
