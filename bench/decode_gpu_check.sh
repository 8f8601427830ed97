#!/usr/bin/env bash
# Decode speed of the generation engine on one GPU, in one command from the repository root:
#   1. `kiln selftest --only kernels`: the multi-block sampler against its CPU reference (batch 1
#      and 64 at Llama 3's 128256-token vocabulary, SmolLM2's 49152, a ragged 1001; greedy with
#      a penalty, top-p, top-k with min-p, the full distribution), the step-row gather, and the
#      key/value-cache kernels; FAIL on any failing kernel check;
#   2. `kiln bench generate --no-python` at the SmolLM2-135M shape (batches 1, 8, 64, 256) and
#      the Llama-3.2-1B shape (batches 1, 64), 64 new tokens: decode tokens/s and the fraction of
#      the weight+cache-read floor, against the targets (>= 100k tok/s at SmolLM2 batch 64,
#      >= 50% of the floor for Llama-3.2-1B at batch 1);
#   3. a small random Llama (transformers, fp32) generating greedily and sampled: token ids
#      identical with and without CUDA graphs, also with --max-batch 3 (8 prompts wait for 3
#      slots, so steps run 3 then 2 live rows and sequences enter freed slots), and with each
#      step queued before the last one's tokens are read or not (--no-overlap), also with a
#      stop string ending sequences at different steps.
#
#   KILN=target/release/kiln OUT=/tmp/out bench/decode_gpu_check.sh
# Prints PASS/FAIL lines and the numbers, exits 1 if any check failed; logs go under $OUT
# (default /tmp/kiln-decode-check). SELFTEST=0 skips step 1 when the kernels have been
# checked on the machine already.
set -uo pipefail
K=${KILN:-target/release/kiln}
O=${OUT:-/tmp/kiln-decode-check}/decode
mkdir -p "$O"
fail=0
pass() { echo "PASS $*"; }
bad() { echo "FAIL $*"; fail=1; }
t0=$(date +%s)
[ -x "$K" ] || { echo "FAIL $K is not an executable kiln binary (set KILN)"; exit 1; }

echo "== 1. kernels against the CPU (kiln selftest --only kernels)"
if [ "${SELFTEST:-1}" = 0 ]; then
  echo "skipped (SELFTEST=0)"; : >"$O/selftest.log"; rc=0
else
  timeout 150 "$K" selftest --only kernels >"$O/selftest.log" 2>&1
  rc=$?
  grep -E "^device" "$O/selftest.log"
  PAT="sample_rows|gather_slot_rows|kv_append|cache_attention|copy_cache_slot"
  grep -E "$PAT" "$O/selftest.log"
  n_pass=$(grep -E "$PAT" "$O/selftest.log" | grep -c "PASS$")
  n_fail=$(grep -E "$PAT" "$O/selftest.log" | grep -vc "PASS$")
  all_fail=$(grep -c "FAIL$" "$O/selftest.log")
  if grep -q "^selftest skipped" "$O/selftest.log"; then
    bad "selftest skipped: $(grep '^selftest skipped' "$O/selftest.log")"
  elif [ "$n_pass" -gt 0 ] && [ "$n_fail" = 0 ]; then
    pass "sampler and cache kernels: $n_pass checks within their bounds"
  else
    bad "sampler and cache kernels: $n_fail of $((n_pass + n_fail)) checks failed (log $O/selftest.log)"
  fi
  if [ "$rc" != 0 ] || [ "$all_fail" != 0 ]; then
    bad "kiln selftest --only kernels exited $rc with $all_fail failing checks:"
    grep "FAIL$" "$O/selftest.log" | head -20
  fi
fi

echo "== 2. kiln bench generate (random weights, 64 new tokens, CUDA graphs on)"
timeout 150 "$K" bench generate --shape smollm2-135m --batches 1,8,64,256 --new-tokens 64 \
  --no-python --out "$O/bench-smollm2" >"$O/bench-smollm2.log" 2>&1 ||
  bad "bench generate smollm2-135m (log $O/bench-smollm2.log)"
timeout 150 "$K" bench generate --shape llama-3.2-1b --batches 1,64 --new-tokens 64 \
  --no-python --out "$O/bench-llama1b" >"$O/bench-llama1b.log" 2>&1 ||
  bad "bench generate llama-3.2-1b (log $O/bench-llama1b.log)"
python3 - "$O/bench-smollm2/results.json" "$O/bench-llama1b/results.json" <<'PY' || fail=1
import json, sys
def points(path):
    try:
        return [p for p in json.load(open(path))["points"] if p["engine"] == "kiln"]
    except Exception as e:
        print(f"FAIL cannot read {path}: {e}")
        return []
smol, big = points(sys.argv[1]), points(sys.argv[2])
for name, ps in [("SmolLM2-135M", smol), ("Llama-3.2-1B", big)]:
    print(f"{name}: batch | prefill tok/s | decode tok/s | of floor")
    for p in ps:
        frac = p.get("floor_fraction")
        print(f"  {p['batch']:>4} | {p['prefill_tokens_per_s']:>12.0f} | {p['decode_tokens_per_s']:>10.0f} | "
              f"{(100 * frac if frac else float('nan')):5.1f}%")
ok = True
k = next((p for p in smol if p["batch"] == 64), None)
if k:
    good = k["decode_tokens_per_s"] >= 100_000
    print(f"{'PASS' if good else 'FAIL'} target: SmolLM2-135M batch 64 decode {k['decode_tokens_per_s']:.0f} new tok/s (target >= 100000)")
    ok &= good
else:
    print("FAIL no SmolLM2-135M batch 64 point"); ok = False
k = next((p for p in big if p["batch"] == 1), None)
if k and k.get("floor_fraction"):
    good = k["floor_fraction"] >= 0.5
    print(f"{'PASS' if good else 'FAIL'} target: Llama-3.2-1B batch 1 decode {k['decode_tokens_per_s']:.0f} tok/s, {100 * k['floor_fraction']:.1f}% of its floor (target >= 50%)")
    ok &= good
else:
    print("FAIL no Llama-3.2-1B batch 1 point with a floor"); ok = False
sys.exit(0 if ok else 1)
PY

echo "== 3. CUDA graphs and slot reuse change no token (random Llama, fp32)"
M="$O/tiny-llama"
if timeout 120 python3 - "$M" "$O/prompts.jsonl" <<'PY'
import json, os, sys
import torch, transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
path, prompts = sys.argv[1], sys.argv[2]
os.makedirs(path, exist_ok=True)
texts = ["the history of Rome", "how a compiler works", "the water cycle", "a recipe for bread",
         "why the sky is blue", "the rules of chess", "a short poem about autumn", "prime numbers"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(texts * 20, trainer)
tok.save(os.path.join(path, "tokenizer.json"))
cfg = tf.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                     rope_theta=10000.0, tie_word_embeddings=False)
torch.manual_seed(0)
tf.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
with open(prompts, "w") as f:
    for t in texts:
        f.write(json.dumps({"prompt": f"Write about {t}."}) + "\n")
PY
then
  run() {  # label, flags
    local label=$1; shift
    timeout 60 "$K" generate --init-from "$M" --device cuda --precision fp32 --prompts "$O/prompts.jsonl" \
      --tokens 96 --seed 3 "$@" --out "$O/$label.jsonl" 2>"$O/$label.err" ||
      { bad "$label: generate failed"; tail -3 "$O/$label.err"; return 1; }
    tail -1 "$O/$label.err"
  }
  compare() {  # label, a, b
    if python3 - "$O/$2.jsonl" "$O/$3.jsonl" "$1" <<'PY'
import json, sys
a = [[s["tokens"] for s in json.loads(l)["samples"]] for l in open(sys.argv[1])]
b = [[s["tokens"] for s in json.loads(l)["samples"]] for l in open(sys.argv[2])]
n = sum(len(s) for r in a for s in r)
same = sum(x == y for ra, rb in zip(a, b) for sa, sb in zip(ra, rb) for x, y in zip(sa, sb))
print(f"  {sys.argv[3]}: {len(a)} prompts, {n} tokens, {same} identical")
sys.exit(0 if a == b and n > 0 else 1)
PY
    then pass "$1: token ids identical"; else bad "$1: token ids differ"; fi
  }
  for mode in greedy sampled; do
    flags=(--temperature 0)
    [ $mode = sampled ] && flags=(--temperature 0.9 --top-p 0.9 --top-k 40 --num-samples 2)
    run $mode-graphs "${flags[@]}" &&
      { grep -q "replayed from CUDA graphs" "$O/$mode-graphs.err" || bad "$mode: no step was replayed from a CUDA graph"; }
    run $mode-direct "${flags[@]}" --no-cuda-graphs
    run $mode-cap3-graphs "${flags[@]}" --max-batch 3
    run $mode-cap3-direct "${flags[@]}" --max-batch 3 --no-cuda-graphs
    compare "$mode, with and without CUDA graphs" $mode-graphs $mode-direct
    compare "$mode, 3 slots for all sequences, with and without CUDA graphs" $mode-cap3-graphs $mode-cap3-direct
    # Steps queued one ahead of the host's reading against steps read one by one, with a
    # stop string ending sequences at different steps while others wait for their slots.
    run $mode-stop-ahead "${flags[@]}" --max-batch 3 --stop e
    run $mode-stop-sequential "${flags[@]}" --max-batch 3 --stop e --no-overlap
    compare "$mode, stop string, 3 slots, steps queued ahead and read one by one" $mode-stop-ahead $mode-stop-sequential
    run $mode-sequential "${flags[@]}" --no-overlap
    compare "$mode, steps queued ahead and read one by one" $mode-graphs $mode-sequential
  done
else
  bad "could not build the random Llama with transformers"
fi

echo "== done in $(( $(date +%s) - t0 )) s; logs in $O"
exit $fail
