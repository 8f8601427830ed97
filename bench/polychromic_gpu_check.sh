#!/usr/bin/env bash
# Polychromic fine-tuning on one GPU, in one command from the repository root (about four
# minutes on an H100):
#   1. `kiln finetune --objective polychromic` of SmolLM2-135M-Instruct (LoRA, bf16) on
#      `kiln make-dataset cue-reply` pairs at lambda 0, 0.5 and 2: 8 replies to each of 8
#      prompts per step, embedded by all-MiniLM-L6-v2, 30 steps; PASS when each run finishes,
#      records D and the generate / embed / forward-backward times of every step, and its
#      Chrome trace holds the generate and embed spans;
#   2. per lambda, `kiln generate --run` on 32 held-out prompts (8 samples each, temperature
#      1) and `kiln diversity --embedder MiniLM`: a table of D, distinct-1/2, Self-BLEU and
#      the held-out CE (summary.json's val_loss); PASS lines when D at lambda 2 is above D at
#      lambda 0 and every held-out CE is within 0.5 nats of lambda 0's;
#   3. the step's time split (median over steps 3..30 at lambda 0.5) beside
#      bench/polychromic_hf_baseline.py, which generates the same replies one prompt at a
#      time with Hugging Face `generate`, embeds them with sentence-transformers and runs a
#      PEFT LoRA forward/backward over the CE batch and the replies; a PASS line when kiln's
#      generation is faster.
#
#   KILN=target/release/kiln OUT=/some/dir bench/polychromic_gpu_check.sh
# SMOL (the GGUF), MINILM (the sentence-transformers directory) and STEPS override the
# defaults; the fixtures come from scripts/fetch-fixtures.sh. transformers cannot read the
# GGUF there, so the baseline loads SmolLM2 from `kiln export --init-from GGUF --to DIR`.
# Prints PASS/FAIL lines and the numbers; exits 1 if any check failed. Logs go under $OUT
# (a temporary directory when unset).
set -uo pipefail
KILN=${KILN:-target/release/kiln}
LOG=${OUT:-$(mktemp -d)}/polychromic
SMOL=${SMOL:-.cache/fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
MINILM=${MINILM:-.cache/fixtures/all-minilm-l6-v2}
STEPS=${STEPS:-30}
SAMPLES=8
PROMPTS=8
NEW=48
LAMBDAS="0 0.5 2"
mkdir -p "$LOG"
failed=0
report() { # report NAME STATUS DETAIL
  if [ "$2" = 0 ]; then echo "PASS $1 $3"; else echo "FAIL $1 $3"; failed=1; fi
}
[ -x "$KILN" ] || { echo "FAIL $KILN is not an executable kiln binary (set KILN)"; exit 1; }
for f in "$SMOL" "$MINILM/config.json"; do
  [ -e "$f" ] || { echo "FAIL $f is missing (scripts/fetch-fixtures.sh fetches it)"; exit 1; }
done

"$KILN" make-dataset cue-reply --out "$LOG/cues.jsonl" >"$LOG/make-dataset.txt" 2>&1
report make-dataset $? "($(wc -l <"$LOG/cues.jsonl") pairs)"
# The last 32 pairs lie in the validation tail fine-tuning holds out (5% of 2695).
tail -n 32 "$LOG/cues.jsonl" | python3 -c '
import json, sys
for l in sys.stdin:
    print(json.dumps({"prompt": json.loads(l)["prompt"]}))' >"$LOG/held_out.jsonl"

echo "== 1. polychromic LoRA fine-tunes at lambda $LAMBDAS ($STEPS steps each)"
for lam in $LAMBDAS; do
  run=$LOG/ft-$lam
  rm -rf "$run"
  timeout 150 "$KILN" finetune --init-from "$SMOL" --data "$LOG/cues.jsonl" --out "$run" \
    --device cuda --objective polychromic --diversity-lambda "$lam" --samples $SAMPLES \
    --prompts-per-step $PROMPTS --max-new-tokens $NEW --embedder "$MINILM" \
    --trace "$LOG/trace-$lam.json" --trace-steps 3..=4 \
    train.steps="$STEPS" train.micro_batch=8 train.seq_len=256 train.eval_every=0 \
    train.eval_batches=8 train.log_every=5 optim.lr=1e-3 optim.warmup_steps=5 \
    >"$LOG/ft-$lam.txt" 2>&1
  rc=$?
  grep -E "polychromic:|step +$STEPS/" "$LOG/ft-$lam.txt" | tail -2
  report "finetune lambda=$lam" $rc "(log: $LOG/ft-$lam.txt)"
  [ $rc = 0 ] || continue
  python3 - "$run/metrics.jsonl" "$STEPS" <<'EOF'
import json, math, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
poly = [r for r in recs if r.get("kind") == "polychromic"]
ok = len(poly) == int(sys.argv[2]) and all(
    math.isfinite(r["diversity"]) and r["generate_s"] > 0 and r["embed_s"] > 0
    and r["forward_backward_s"] > 0 for r in poly)
sys.exit(0 if ok else 1)
EOF
  report "metrics lambda=$lam" $? "(a polychromic record with D and the phase times for each of $STEPS steps)"
  grep -q '"generate"' "$LOG/trace-$lam.json" && grep -q '"embed"' "$LOG/trace-$lam.json"
  report "trace lambda=$lam" $? "(generate and embed spans in $LOG/trace-$lam.json)"
done

echo "== 2. held-out diversity per lambda (kiln generate + kiln diversity with MiniLM)"
for lam in $LAMBDAS; do
  run=$LOG/ft-$lam
  [ -f "$run/summary.json" ] || continue
  timeout 90 "$KILN" generate --run "$run" --device cuda --prompts "$LOG/held_out.jsonl" \
    --num-samples $SAMPLES --tokens $NEW --temperature 1 --top-k 0 --top-p 1 --seed 7 \
    --out "$LOG/replies-$lam.jsonl" >"$LOG/generate-$lam.txt" 2>&1
  report "generate lambda=$lam" $? "(log: $LOG/generate-$lam.txt)"
  timeout 60 "$KILN" diversity "$LOG/replies-$lam.jsonl" --embedder "$MINILM" --device cuda \
    --out "$LOG/diversity-$lam.json" >"$LOG/diversity-$lam.txt" 2>&1
  report "diversity lambda=$lam" $? "(log: $LOG/diversity-$lam.txt)"
done
python3 - "$LOG" $LAMBDAS <<'EOF'
import json, os, sys
log, lams = sys.argv[1], sys.argv[2:]
rows = {}
print(f"{'lambda':>7} {'D':>7} {'distinct-1':>10} {'distinct-2':>10} {'self-BLEU':>9} {'held-out CE':>11} {'train D (last)':>14}")
for lam in lams:
    try:
        d = json.load(open(f"{log}/diversity-{lam}.json"))
        s = json.load(open(f"{log}/ft-{lam}/summary.json"))
        poly = [json.loads(l) for l in open(f"{log}/ft-{lam}/metrics.jsonl")]
        last = [r["diversity"] for r in poly if r.get("kind") == "polychromic"][-5:]
    except (OSError, ValueError, KeyError) as e:
        print(f"{lam:>7} missing ({e})")
        continue
    rows[lam] = (d["semantic_diversity"], s["val_loss"])
    print(f"{lam:>7} {d['semantic_diversity']:7.4f} {d['distinct_1']:10.4f} {d['distinct_2']:10.4f} "
          f"{d['self_bleu']:9.4f} {s['val_loss']:11.4f} {sum(last) / max(len(last), 1):14.4f}")
json.dump({k: {"D": v[0], "val_loss": v[1]} for k, v in rows.items()},
          open(f"{log}/table.json", "w"), indent=1)
EOF
python3 - "$LOG/table.json" <<'EOF'
import json, sys
t = json.load(open(sys.argv[1]))
sys.exit(0 if "0" in t and "2" in t and t["2"]["D"] > t["0"]["D"] else 1)
EOF
report "D rises with lambda" $? "(held-out D at lambda 2 above lambda 0)"
python3 - "$LOG/table.json" <<'EOF'
import json, sys
t = json.load(open(sys.argv[1]))
sys.exit(0 if "0" in t and all(v["val_loss"] < t["0"]["val_loss"] + 0.5 for v in t.values()) else 1)
EOF
report "held-out CE bound" $? "(every lambda within 0.5 nats of lambda 0's held-out CE)"

echo "== 3. the step's time split beside generate-one-prompt-at-a-time (Hugging Face)"
timeout 60 "$KILN" export --init-from "$SMOL" --to "$LOG/smol-hf" >"$LOG/export.txt" 2>&1
report "export SmolLM2 for transformers" $? "(log: $LOG/export.txt)"
timeout 150 python3 bench/polychromic_hf_baseline.py --model "$LOG/smol-hf" --embedder "$MINILM" \
  --prompts "$LOG/cues.jsonl" --prompts-per-step $PROMPTS --samples $SAMPLES \
  --max-new-tokens $NEW --micro-batch 8 --seq-len 256 >"$LOG/hf_baseline.json" 2>"$LOG/hf_baseline.txt"
report "Hugging Face baseline" $? "(log: $LOG/hf_baseline.txt)"
python3 - "$LOG/ft-0.5/metrics.jsonl" "$LOG/hf_baseline.json" <<'EOF'
import json, statistics, sys
try:
    poly = [json.loads(l) for l in open(sys.argv[1])]
    poly = [r for r in poly if r.get("kind") == "polychromic" and r["step"] >= 3]
    hf = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
except (OSError, ValueError, IndexError) as e:
    print(f"no timings to compare ({e})")
    sys.exit(1)
med = lambda k: statistics.median(r[k] for r in poly)
kiln = {k: med(k) for k in ("generate_s", "embed_s", "forward_backward_s")}
tokens = statistics.median(r["reply_tokens"] for r in poly)
print(f"{'phase':<18} {'kiln (s)':>9} {'HF one prompt at a time (s)':>28} {'ratio':>7}")
for k in kiln:
    print(f"{k[:-2]:<18} {kiln[k]:9.3f} {hf[k]:28.3f} {hf[k] / max(kiln[k], 1e-9):6.1f}x")
tk, th = sum(kiln.values()), sum(hf[k] for k in kiln)
print(f"{'step (3 phases)':<18} {tk:9.3f} {th:28.3f} {th / max(tk, 1e-9):6.1f}x")
print(f"replies per step: kiln {poly[0]['replies']} ({tokens:.0f} tokens), HF {hf['replies']} ({hf['reply_tokens']} tokens)")
sys.exit(0 if kiln["generate_s"] < hf["generate_s"] else 1)
EOF
report "batched generation beats one prompt at a time" $? ""

echo
if [ $failed = 0 ]; then echo "ALL PASS"; else echo "SOME FAILED"; fi
exit $failed
