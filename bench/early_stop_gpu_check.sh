#!/usr/bin/env bash
# Early stopping and the best checkpoint on a real chat fine-tune that overfits, in one
# command: SmolLM2-135M-Instruct from its GGUF, LoRA rank 16, bf16, batch 16 x 256, on 1900
# cue/reply chats built from the bundled corpus (bench/shakespeare_chat.py) with 100 more
# as a separate validation file (--val-data). The same fine-tune runs twice:
#   full: STEPS steps, evaluated every EVERY steps (the overfitting curve);
#   early: the same, with train.early_stop_patience=PATIENCE and train.keep_best=true.
# It prints both runs' evaluations, where the second stopped and which checkpoint its
# adapters came from, then two sampled replies to one held-out cue from the full run's last
# checkpoint and from the early run's best.
#
#   KILN=target/release/kiln bench/early_stop_gpu_check.sh SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail
K=${KILN:-target/release/kiln} GGUF=$1 W=${WORK:-/tmp/kiln-early-stop}
STEPS=${STEPS:-400} EVERY=${EVERY:-25} PATIENCE=${PATIENCE:-3}
DEVICE=${DEVICE:-cuda} PRECISION=${PRECISION:-bf16-mixed}
mkdir -p "$W"
zcat data/shakespeare.txt.gz > "$W/corpus.txt"
python3 bench/shakespeare_chat.py "$W/corpus.txt" "$W/all.jsonl" 2000
head -n 1900 "$W/all.jsonl" > "$W/train.jsonl"
tail -n 100 "$W/all.jsonl" > "$W/val.jsonl"
python3 - "$W/val.jsonl" "$W/cue.jsonl" <<'PY'
import json, sys
chat = [json.loads(l) for l in open(sys.argv[1])][-1]
with open(sys.argv[2], "w") as out:
    out.write(json.dumps({"messages": [m for m in chat["messages"] if m["role"] != "assistant"]}) + "\n")
PY
common=(--init-from "$GGUF" --data "$W/train.jsonl" --val-data "$W/val.jsonl" --device "$DEVICE"
  train.precision="$PRECISION" train.seq_len=256 train.micro_batch=16 train.steps="$STEPS"
  train.eval_every="$EVERY" train.log_every="$EVERY" train.checkpoint_every=0 train.eval_at_start=true
  optim.lr=3e-3 optim.warmup_steps=10)
for run in full early; do
  rm -rf "$W/$run"
  extra=()
  [ "$run" = early ] && extra=(train.early_stop_patience="$PATIENCE" train.keep_best=true)
  echo "== $run ${extra[*]:-}"
  start=$EPOCHREALTIME
  "$K" finetune "${common[@]}" "${extra[@]}" --out "$W/$run" 2>&1 \
    | grep -E "val loss|stopping early|done:|best val loss|adapters:|validation examples"
  echo "   wall $(awk "BEGIN { print $EPOCHREALTIME - $start }") s"
done
echo "== two replies (temperature 0.8, top-p 0.9, seed 1) to the last held-out cue"
python3 -c "import json,sys; print('cue:', json.loads(open(sys.argv[1]).readline())['messages'][-1]['content'][:200])" "$W/cue.jsonl"
for src in "full" "early --checkpoint best"; do
  set -- $src
  "$K" generate --run "$W/$1" ${2:+$2 $3} --chat --prompts "$W/cue.jsonl" --num-samples 2 \
    --tokens 60 --temperature 0.8 --top-p 0.9 --seed 1 --device "$DEVICE" --out "$W/replies-$1.jsonl" >/dev/null 2>&1
  python3 - "$W/replies-$1.jsonl" "$src" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    for s in r.get("samples") or r.get("texts") or [r.get("text")]:
        s = s["text"] if isinstance(s, dict) else s
        print(f"[{sys.argv[2]}] {s.strip()[:240]!r}")
PY
done
cp "$W/full/metrics.jsonl" "$W/full-metrics.jsonl"; cp "$W/early/metrics.jsonl" "$W/early-metrics.jsonl"
