#!/usr/bin/env bash
# Fine-tuned encoders on one GPU, in one command (a few minutes on an H100):
#  1. `kiln selftest`: the padded softmax and whole-row softmax backward the encoder trains
#     through, against their CPU references (with the rest of the suite);
#  2. `kiln classify` on play-pairs with MiniLM (cross pair encoding): the frozen encoder,
#     then `--finetune lora` and `--finetune full` on the GPU, printing macro-F1 and the
#     wall time of each mode. A fine-tuned mode passes when it runs and its macro-F1 is above
#     chance (0.5 for two balanced classes).
# Run from the repository root:  KILN=target/release/kiln OUT=/tmp/out bench/encoder_finetune_gpu_check.sh
# EPOCHS (default 3) sets the fine-tuning epochs; PRECISION (default bf16) the encoder's.
set -uo pipefail
KILN=${KILN:-target/release/kiln}
OUT=${OUT:-/tmp/kiln-encoder-finetune-check}
FIX=${FIX:-.cache/fixtures}
MINILM=$FIX/all-minilm-l6-v2
EPOCHS=${EPOCHS:-3}
PRECISION=${PRECISION:-bf16}
mkdir -p "$OUT"
fail=0
step() { echo; echo "== $*"; }
check() { if [ "$1" -eq 0 ]; then echo "PASS $2"; else echo "FAIL $2"; fail=1; fi; }

step "selftest (log: $OUT/selftest.txt; SELFTEST=0 skips it)"
if [ "${SELFTEST:-1}" != 0 ]; then
  "$KILN" selftest >"$OUT/selftest.txt" 2>&1
  rc=$?
  grep -E "padded_softmax|softmax_backward_rows|masked_attention" "$OUT/selftest.txt"
  check $rc "kiln selftest (exit $rc; $(grep -c PASS "$OUT/selftest.txt") PASS lines, $(grep -c FAIL "$OUT/selftest.txt") FAIL lines)"
fi

step "kiln classify on play-pairs with MiniLM: frozen, LoRA, full (reports under $OUT/classify-*)"
"$KILN" make-dataset play-pairs --out "$OUT/pairs.jsonl" >/dev/null
echo "$(wc -l <"$OUT/pairs.jsonl") records"
run() {
  local name=$1; shift
  local t0 t1 rc f1
  t0=$(date +%s.%N)
  "$KILN" classify --init-from "$MINILM" --data "$OUT/pairs.jsonl" --folds 5 --device cuda \
    --precision "$PRECISION" --no-cache --batch-size 32 --out "$OUT/classify-$name" "$@" \
    >"$OUT/classify-$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  f1=$(grep -o 'macro-F1 [0-9.]* ± [0-9.]*' "$OUT/classify-$name.log" | tail -1)
  printf '%-8s %s, %s s\n' "$name" "${f1:-no macro-F1}" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
  grep -m1 -- "- encoder:" "$OUT/classify-$name/report.md" 2>/dev/null
  check $rc "classify $name (log: $OUT/classify-$name.log)"
  if [ "$name" != frozen ] && [ $rc -eq 0 ]; then
    mean=$(echo "$f1" | awk '{print $2}')
    awk -v m="$mean" 'BEGIN { exit !(m > 0.5) }'
    check $? "classify $name macro-F1 $mean above chance"
  fi
}
run frozen
run lora --finetune lora --epochs "$EPOCHS" --patience 2
run full --finetune full --epochs "$EPOCHS" --patience 2

echo
if [ $fail -eq 0 ]; then echo "ALL PASS"; else echo "SOME FAILED"; fi
exit $fail
