#!/usr/bin/env bash
# `kiln plan --generate` against real generation calls on one GPU: a SmolLM2-135M-shaped Llama
# (random weights, GPT-2's tokenizer, saved after one training step) sampled with 64-token
# prompts and 128 new tokens at several batch shapes; each call's pool peak (the closing line
# of `kiln generate`) beside the plan's, in bytes.
#
#   KILN=target/release/kiln OUT=/tmp/out bench/plan_generate_gpu_check.sh
set -uo pipefail
K=${KILN:-target/release/kiln}
O=${OUT:-/tmp/kiln-plan-generate-check}
mkdir -p "$O"
SHAPE="model.kind=llama model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.head_dim=64 model.ffn_hidden=1536 model.rope_theta=100000 model.context=2048 train.seq_len=256 data.tokenizer=gpt2"
"$K" train --profile none -q --device cuda --out "$O/run" $SHAPE train.steps=1 train.micro_batch=2 \
  train.eval_every=0 train.checkpoint_every=0 >"$O/train.log" 2>&1 || { echo "FAIL train (see $O/train.log)"; exit 1; }
# " the" is one GPT-2 token, so each prompt is exactly 64 tokens.
python3 -c 'import json; [print(json.dumps({"prompt": " the" * 64})) for _ in range(64)]' >"$O/prompts64.jsonl"
fail=0
check() {  # prompts, samples, [max batch]
  local prompts=$1 samples=$2 mb=${3:-} extra=() planned measured
  [ -n "$mb" ] && extra=(--max-batch "$mb")
  head -n "$prompts" "$O/prompts64.jsonl" >"$O/p.jsonl"
  planned=$("$K" plan --generate --profile none $SHAPE --prompts "$prompts" --num-samples "$samples" \
    --prompt-tokens 64 --tokens 128 "${extra[@]}" --json 2>"$O/plan.err" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["plan"]["pool_peak"])') || { echo "FAIL plan: $(tail -n 3 "$O/plan.err")"; fail=1; return; }
  "$K" generate --run "$O/run" --device cuda --prompts "$O/p.jsonl" --num-samples "$samples" \
    --tokens 128 "${extra[@]}" --seed 1 --out "$O/out.jsonl" 2>"$O/gen.err" >/dev/null ||
    { echo "FAIL generate: $(tail -n 3 "$O/gen.err")"; fail=1; return; }
  measured=$(grep -o 'pool peak [^(]*(\([0-9]*\) bytes)' "$O/gen.err" | grep -o '([0-9]*' | tr -d '(')
  tail -n 1 "$O/gen.err"
  python3 - "$prompts" "$samples" "${mb:-all}" "$planned" "$measured" <<'PY'
import sys
p, s, mb, planned, measured = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
d = (planned - measured) / measured
print(f"{p} prompts x {s} samples, at once {mb}: planned {planned} B, measured {measured} B, {100 * d:+.4f}%")
PY
}
check 1 1
check 8 8
check 64 1
check 16 8 32
echo "exit $fail"
exit $fail
