#!/usr/bin/env bash
# Encoders and classification on one GPU, in one command (about 3 minutes on an H100):
#  1. `kiln selftest`: the encoder kernels (masked attention, erf GELU, layernorm with eps)
#     against their CPU references, with the rest of the suite;
#  2. MiniLM embeddings in fp32 against sentence-transformers' encode on 3000 varied texts
#     from the bundled corpus: cosine >= 0.9999 each, identical token ids, same truncations;
#  3. encoding speed, kiln against sentence-transformers, same GPU, batch 64, f16 and bf16;
#  4. `kiln classify` on play-pairs with MiniLM (cross and bi pair encodings) and with the
#     SmolLM2 GGUF as frozen encoders, a rerun served from the feature cache, and kiln's
#     folds beside scikit-learn's StratifiedGroupKFold.
# Run from the repository root:  KILN=target/release/kiln OUT=/tmp/out bench/encoder_gpu_check.sh
set -uo pipefail
KILN=${KILN:-target/release/kiln}
OUT=${OUT:-/tmp/kiln-encoder-check}
FIX=${FIX:-.cache/fixtures}
MINILM=$FIX/all-minilm-l6-v2
GGUF=$FIX/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
PY="python3 bench/encoder_check.py"
mkdir -p "$OUT"
fail=0
step() { echo; echo "== $*"; }
check() { if [ "$1" -eq 0 ]; then echo "PASS $2"; else echo "FAIL $2"; fail=1; fi; }

step "selftest (log: $OUT/selftest.txt; SELFTEST=0 skips it)"
if [ "${SELFTEST:-1}" != 0 ]; then
"$KILN" selftest >"$OUT/selftest.txt" 2>&1
rc=$?
grep -E "masked_attention|gelu_erf|layernorm_forward_eps" "$OUT/selftest.txt"
check $rc "kiln selftest (exit $rc; $(grep -c PASS "$OUT/selftest.txt") PASS lines, $(grep -c FAIL "$OUT/selftest.txt") FAIL lines)"
fi

step "MiniLM embeddings and token ids against sentence-transformers (fp32)"
$PY sentences "$OUT/texts.txt" 3000
"$KILN" embed --init-from "$MINILM" --input "$OUT/texts.txt" --out "$OUT/kiln_fp32.safetensors" \
  --device cuda --precision fp32 --batch-size 64 2>&1 | tee "$OUT/embed_fp32.log"
"$KILN" tokenize --tokenizer "$MINILM" --special --input "$OUT/texts.txt" >"$OUT/kiln_ids.jsonl"
$PY parity "$MINILM" "$OUT/texts.txt" "$OUT/kiln_fp32.safetensors" "$OUT/kiln_ids.jsonl" "$OUT/embed_fp32.log"
check $? "embedding parity"

step "encoding speed, batch 64 (texts/s from tokenisation to embeddings on the host)"
for p in f16 bf16; do
  "$KILN" embed --init-from "$MINILM" --input "$OUT/texts.txt" --out "$OUT/warm.jsonl" --device cuda \
    --precision $p --batch-size 64 >/dev/null 2>&1  # compiles and caches the kernels
  "$KILN" embed --init-from "$MINILM" --input "$OUT/texts.txt" --out "$OUT/kiln_$p.safetensors" \
    --device cuda --precision $p --batch-size 64 2>&1 | tee "$OUT/embed_$p.log" | tail -1
  echo "{\"engine\": \"kiln\", \"precision\": \"$p\", \"batch\": 64, \"sentences_per_s\": $(grep -o '([0-9]* texts/s' "$OUT/embed_$p.log" | tr -dc 0-9)}"
done
$PY speed "$MINILM" "$OUT/texts.txt" 64

step "kiln classify on play-pairs (reports under $OUT/classify-*)"
"$KILN" make-dataset play-pairs --out "$OUT/pairs.jsonl"
run() {
  local name=$1; shift
  "$KILN" classify --data "$OUT/pairs.jsonl" --folds 5 --device cuda --cache-dir "$OUT/cache" \
    --out "$OUT/classify-$name" "$@" 2>&1 | tee "$OUT/classify-$name.log" | grep -E "features:|macro-F1"
  check ${PIPESTATUS[0]} "classify $name"
}
run minilm-cross --init-from "$MINILM" --precision fp32
run minilm-bi --init-from "$MINILM" --precision fp32 --pair-encoding bi
run minilm-bi-rerun --init-from "$MINILM" --precision fp32 --pair-encoding bi --head mlp
grep -q '"hit": true' "$OUT/classify-minilm-bi-rerun/metrics.json"
check $? "the rerun's features came from the cache"
run smollm2-bi --init-from "$GGUF" --precision bf16 --pair-encoding bi --max-length 128

step "folds beside scikit-learn's StratifiedGroupKFold"
$PY folds "$OUT/pairs.jsonl" "$OUT/classify-minilm-bi/metrics.json" 5 0
check $? "fold comparison"

echo
[ $fail -eq 0 ] && echo "ALL PASS" || echo "SOME CHECKS FAILED"
exit $fail
