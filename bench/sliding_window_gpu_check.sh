#!/usr/bin/env bash
# Sliding-window attention on one GPU, in one command from the repository root:
#   1. `kiln selftest --only kernels`: the windowed attention kernels against the CPU reference
#      (CUDA-core f32/f16, tensor cores in bf16 at head size 64, forward and backward), a window
#      of the whole sequence against none bit for bit, and the windowed decode kernel;
#   2. parity with transformers (bench/llama_parity.py --windowed): random-initialised Mistral
#      (window 64, every layer) and Qwen2 (window 48 from layer 2 on) saved by transformers,
#      ~100-token prompts and 128 greedy tokens in fp32: greedy tokens and log-probabilities
#      against transformers, and against the same weights without the window (must differ);
#   3. a few bf16-mixed training steps of the windowed Mistral on the GPU (tensor-core kernels).
#
#   KILN=target/release/kiln OUT=/tmp/out bench/sliding_window_gpu_check.sh
# Needs the all-MiniLM-L6-v2 fixture (its tokenizer) under .cache/fixtures/. Prints PASS/FAIL
# lines and the numbers, exits 1 if any check failed; logs go under $OUT (default
# /tmp/kiln-swa-check).
set -uo pipefail
K=${KILN:-target/release/kiln}
O=${OUT:-/tmp/kiln-swa-check}/swa
MINILM=${MINILM:-.cache/fixtures/all-minilm-l6-v2}
mkdir -p "$O"
fail=0
pass() { echo "PASS $*"; }
bad() { echo "FAIL $*"; fail=1; }
t0=$(date +%s)
[ -x "$K" ] || { echo "FAIL $K is not an executable kiln binary (set KILN)"; exit 1; }

echo "== 1. windowed kernels against the CPU (kiln selftest --only kernels)"
timeout 200 "$K" selftest --only kernels >"$O/selftest.log" 2>&1
rc=$?
grep -E "^device" "$O/selftest.log"
grep -E "_window" "$O/selftest.log"
n_pass=$(grep -E "_window" "$O/selftest.log" | grep -c "PASS$")
n_fail=$(grep -E "_window" "$O/selftest.log" | grep -vc "PASS$")
if grep -q "^selftest skipped" "$O/selftest.log"; then
  bad "selftest skipped: $(grep '^selftest skipped' "$O/selftest.log")"
elif [ "$n_pass" -gt 0 ] && [ "$n_fail" = 0 ]; then
  pass "windowed kernels: $n_pass checks within their bounds"
else
  bad "windowed kernels: $n_fail of $((n_pass + n_fail)) checks failed (log $O/selftest.log)"
fi
[ "$rc" = 0 ] || echo "note: kiln selftest exited $rc; other kernels' failures: $(grep -c 'FAIL$' "$O/selftest.log")"

echo "== 2. parity with transformers (Mistral window 64, Qwen2 window 48 from layer 2)"
mkdir -p "$O/tok"
for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do
  [ -f "$MINILM/$f" ] && cp "$MINILM/$f" "$O/tok/"
done
if [ ! -f "$O/tok/tokenizer.json" ]; then
  bad "no tokenizer.json under $MINILM (set MINILM to a directory holding one)"
else
  timeout 240 python3 bench/llama_parity.py --kiln "$K" --tokenizer "$O/tok" --work "$O/parity" \
    --windowed --json "$O/parity.json" 2>&1 | tee "$O/parity.log" | grep -E "^\||refused|Error"
  if python3 - "$O/parity.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
ok = len(rows) == 2
for r in rows:
    if "error" in r:
        print(f"FAIL {r['model']}: kiln refused: {r['error']}")
        ok = False
        continue
    good = (r["same"] >= 0.95 * r["total"] and r["max_logprob_diff"] < 2e-3
            and r["control_diff"] > 50 * max(r["max_logprob_diff"], 1e-4) and r["longest"] > 160)
    print(f"{'PASS' if good else 'FAIL'} {r['model']}: {r['same']}/{r['total']} greedy tokens, "
          f"max |logprob diff| {r['max_logprob_diff']:.2e} (bound 2e-3), without the window "
          f"{r['control_diff']:.2e} (must be far larger), longest sequence {r['longest']}")
    ok &= good
sys.exit(0 if ok else 1)
PY
  then :; else fail=1; fi
fi

echo "== 3. bf16-mixed training steps of the windowed Mistral on the GPU"
M="$O/parity/mistral-swa64"
if [ -d "$M" ]; then
  rm -rf "$O/train"
  if timeout 120 "$K" train --init-from "$M" --device cuda --out "$O/train" -q \
      train.precision=bf16-mixed train.seq_len=256 train.micro_batch=4 train.steps=5 \
      train.eval_every=0 train.eval_batches=1 >"$O/train.log" 2>&1 &&
    python3 - "$O/train/metrics.jsonl" <<'PY'
import json, math, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
losses = [r["loss"] for r in recs if r.get("kind") == "train" and "loss" in r]
print(f"  train losses: {[round(l, 3) for l in losses]}")
sys.exit(0 if losses and all(math.isfinite(l) for l in losses) else 1)
PY
  then pass "windowed Mistral trains 5 bf16-mixed steps on the GPU with finite losses"
  else bad "windowed Mistral training (log $O/train.log)"; tail -5 "$O/train.log"; fi
else
  bad "no saved Mistral model at $M (step 2 did not run)"
fi

echo "== done in $(( $(date +%s) - t0 )) s"
exit $fail
