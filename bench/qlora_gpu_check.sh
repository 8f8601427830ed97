#!/usr/bin/env bash
# QLoRA on one GPU, in one command from the repository root:
#   1. `kiln selftest --only nf4`: the CUDA NF4 dequantisation against the CPU reference;
#   2. a short QLoRA fine-tune (`kiln finetune --qlora`, bf16-mixed) of a random SmolLM2-135M-
#      shaped Hugging Face directory (bench/llama_parity.py's save) on chats from the bundled
#      corpus: the loss falls, PEFT loads the adapter onto the base, and the merged export
#      (`kiln export`: the dequantised NF4 base plus the adapters) loads in transformers with
#      finite logits close to the base's;
#   3. `kiln bench finetune --shape llama-3.2-1b` (kiln LoRA, kiln QLoRA, transformers + PEFT
#      LoRA; rank 16, 8 x 1024) with the targets: QLoRA base weights under 1 GiB on the GPU,
#      QLoRA tokens/s at least 0.8x kiln's bf16 LoRA.
#
#   KILN=target/release/kiln OUT=/tmp/out bench/qlora_gpu_check.sh [TOKENIZER_DIR]
# TOKENIZER_DIR holds SmolLM2's tokenizer.json and tokenizer_config.json; without it the
# tokenizer is taken from the GGUF fixture (.cache/fixtures/smollm2/, or $GGUF) through
# `kiln export --init-from`. Prints PASS/FAIL lines and the numbers; exits 1 if any check
# failed. Logs and reports go under $OUT (default /tmp/kiln-qlora-check).
set -uo pipefail
K=${KILN:-target/release/kiln}
O=${OUT:-/tmp/kiln-qlora-check}
GGUF=${GGUF:-.cache/fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
mkdir -p "$O"
fail=0
pass() { echo "PASS $*"; }
bad() { echo "FAIL $*"; fail=1; }
t0=$(date +%s)
[ -x "$K" ] || { echo "FAIL $K is not an executable kiln binary (set KILN)"; exit 1; }

echo "== 1. NF4 dequantisation on the GPU against the CPU reference (kiln selftest --only nf4)"
timeout 150 "$K" selftest --only nf4 >"$O/selftest.txt" 2>&1
rc=$?
grep -E "^(device|nf4)" "$O/selftest.txt" | head -20
grep -q "^selftest skipped" "$O/selftest.txt" && rc=1
if [ $rc = 0 ]; then pass "selftest-nf4 ($(grep -c '^nf4.*PASS$' "$O/selftest.txt") checks)"
else bad "selftest-nf4 (log $O/selftest.txt)"; fi

echo "== 2. QLoRA fine-tune of a random SmolLM2-135M-shaped model on the GPU"
TOK=${1:-}
if [ -z "$TOK" ]; then
  TOK="$O/tokenizer"
  rm -rf "$O/gguf-hf" "$TOK" && mkdir -p "$TOK"
  "$K" export --init-from "$GGUF" --to "$O/gguf-hf" >"$O/tokenizer-export.txt" 2>&1 \
    || bad "tokenizer from $GGUF (log $O/tokenizer-export.txt)"
  cp "$O"/gguf-hf/tokenizer*.json "$O"/gguf-hf/special_tokens_map.json "$TOK"/ 2>/dev/null
fi
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[1][1], '$O/smol', '$TOK')" >"$O/save.txt" 2>&1 || bad "random SmolLM2 directory (log $O/save.txt)"
zcat data/shakespeare.txt.gz >"$O/corpus.txt"
python3 bench/shakespeare_chat.py "$O/corpus.txt" "$O/chat.jsonl" 2000 >/dev/null
rm -rf "$O/qft" "$O/qmerged"
timeout 120 "$K" finetune --init-from "$O/smol" --data "$O/chat.jsonl" --out "$O/qft" \
  --device cuda --qlora train.precision=bf16-mixed train.seq_len=256 train.micro_batch=8 \
  train.steps=40 train.eval_every=0 train.log_every=1 optim.lr=5e-3 optim.warmup_steps=2 \
  >"$O/qft.txt" 2>&1
rc=$?
grep -E "QLoRA:|low-rank|done:|val loss|adapters:" "$O/qft.txt"
if [ $rc = 0 ]; then pass "qlora-finetune"; else bad "qlora-finetune (log $O/qft.txt)"; fi
timeout 120 "$K" export --run "$O/qft" --to "$O/qmerged" >"$O/export.txt" 2>&1 \
  || bad "qlora-export (log $O/export.txt)"
python3 bench/qlora_run_checks.py --base "$O/smol" --run "$O/qft" --merged "$O/qmerged" \
  --nf4-bound 0.15 || fail=1

echo "== 3. kiln bench finetune --shape llama-3.2-1b (LoRA, QLoRA, transformers + PEFT)"
rm -rf "$O/bench"
timeout 200 "$K" bench finetune --shape llama-3.2-1b --steps 8 --warmup 2 --out "$O/bench" \
  >"$O/bench.txt" 2>&1
rc=$?
grep -E "^(kiln|transformers|target|running)" "$O/bench.txt"
[ $rc = 0 ] || bad "bench-finetune (log $O/bench.txt)"
python3 - "$O/bench/results.json" <<'PY' || fail=1
import json, sys
r = json.load(open(sys.argv[1]))
by = {e["engine"].split(" (")[0]: e for e in r["engines"]}
print(f"{'engine':<28} {'tokens/s':>10} {'peak GiB':>9} {'base GiB':>9}")
for e in r["engines"]:
    print(f"{e['engine']:<28} {e['tokens_per_s']:>10.0f} {e['peak_bytes'] / 2**30:>9.2f} "
          f"{e['base_weight_bytes'] / 2**30:>9.3f}")
for s in r.get("skipped", []):
    print("skipped:", s)
q, l = by.get("kiln QLoRA"), by.get("kiln LoRA")
ok = q is not None and l is not None
if ok:
    gib = q["base_weight_bytes"] / 2**30
    ratio = q["tokens_per_s"] / l["tokens_per_s"]
    print(("PASS" if gib < 1 else "FAIL"), f"qlora-base-under-1GiB ({gib:.3f} GiB; workspace "
          f"{q['workspace_bytes'] / 2**20:.0f} MiB; bf16 LoRA base {l['base_weight_bytes'] / 2**30:.3f} GiB)")
    print(("PASS" if ratio >= 0.8 else "FAIL"), f"qlora-speed ({ratio:.2f}x kiln's bf16 LoRA; target 0.8x)")
    ok = gib < 1 and ratio >= 0.8
else:
    print("FAIL bench-finetune (no kiln LoRA/QLoRA results)")
for t in r.get("targets", []):
    print(f"target: {t['what']}: {t['measured']} ({'met' if t['met'] else 'not met'})")
sys.exit(0 if ok else 1)
PY

echo "== done in $(( $(date +%s) - t0 )) s; logs in $O"
if [ $fail = 0 ]; then echo "PASS qlora-gpu-check"; else echo "FAIL qlora-gpu-check"; fi
exit $fail
