#!/usr/bin/env bash
# Tensor-core attention in bf16 and f16 at head sizes 64 and 128, on one GPU, in one command
# from the repository root:
#   1. `kiln selftest --only kernels`: every attention kernel against the CPU reference
#      (forward and backward; causal; grouped-query layouts, 8 query heads over 2 key/value
#      heads; sliding windows; f16 score gradients past f16's range; a whole-sequence window
#      bit for bit against none; f32 at head size 128 refused with an error);
#   2. `kiln bench kernels` at head sizes 64 (GPT-2: 768 / 12) and 128 (Qwen3-0.6B: 2048 / 16),
#      bf16 and f16, 8 x 1024 tokens: the attention rows beside PyTorch's SDPA;
#   3. GPT-2 small (124M, micro-batch 8, 1024 tokens) for $STEPS steps in fp16-mixed and in
#      bf16-mixed: median tokens/s after step 10 of each (fp16 used to fall back to CUDA-core
#      attention, ~6x slower than bf16);
#   4. a random Llama-family model of Qwen3-0.6B's shape (28 layers, width 1024, 16 heads of
#      128 over 8 key/value heads, FFN 3072, per-head q/k norms, tied head) for 10 bf16-mixed
#      steps of 4 x 1024 tokens: every loss finite (head size 128 had no GPU attention kernel).
#
#   KILN=target/release/kiln OUT=/tmp/out bench/attention_tc_gpu_check.sh
# Prints PASS/FAIL lines and the numbers, exits 1 if any check failed; logs go under $OUT
# (default /tmp/kiln-attention-tc-check). Needs python3 (PyTorch for the SDPA column).
set -uo pipefail
K=${KILN:-target/release/kiln}
O=${OUT:-/tmp/kiln-attention-tc-check}/attention_tc
STEPS=${STEPS:-30}
mkdir -p "$O"
fail=0
pass() { echo "PASS $*"; }
bad() { echo "FAIL $*"; fail=1; }
t0=$(date +%s)
[ -x "$K" ] || { echo "FAIL $K is not an executable kiln binary (set KILN)"; exit 1; }

echo "== 1. attention kernels against the CPU (kiln selftest --only kernels)"
timeout 150 "$K" selftest --only kernels >"$O/selftest.log" 2>&1
rc=$?
grep -E "^device|^first start|^second start" "$O/selftest.log"
# Table rows only ("kernel | dtype | shape | error | bound | result"), not the error lines.
ROWS='^attention[^ ]* +\| '
grep -E "$ROWS" "$O/selftest.log"
grep -E "^[0-9]+ checks, [0-9]+ failed" "$O/selftest.log"
n_pass=$(grep -E "$ROWS" "$O/selftest.log" | grep -c "PASS$")
n_fail=$(grep -E "$ROWS" "$O/selftest.log" | grep -vc "PASS$")
if grep -q "^selftest skipped" "$O/selftest.log"; then
  bad "selftest skipped: $(grep '^selftest skipped' "$O/selftest.log")"
elif [ "$n_pass" -gt 0 ] && [ "$n_fail" = 0 ]; then
  pass "attention kernels: $n_pass checks within their bounds"
else
  bad "attention kernels: $n_fail of $((n_pass + n_fail)) checks failed (log $O/selftest.log)"
  grep -E "^attention[^|]*: " "$O/selftest.log"
fi
[ "$rc" = 0 ] || echo "note: kiln selftest exited $rc; other kernels' failures: $(grep -c 'FAIL$' "$O/selftest.log")"

echo "== 2. attention timings beside PyTorch SDPA (kiln bench kernels --only compute)"
for shape in "64 768 12" "128 2048 16"; do
  set -- $shape
  timeout 150 "$K" bench kernels --only compute --dtypes bf16,f16 --rows 8192 --seq 1024 \
    --channels "$2" --heads "$3" --reps 10 --warmup 2 --out "$O/kernels_hs$1" \
    >"$O/kernels_hs$1.log" 2>&1 || echo "note: kiln bench kernels (head size $1) exited $?"
done
python3 - "$O/kernels_hs64/results.json" "$O/kernels_hs128/results.json" <<'PY'
import json, sys
ok = True
print(f"{'kernel':<28} {'dtype':<5} {'head':>4} {'kiln us':>9} {'SDPA us':>9} {'SDPA/kiln':>9}  TFLOP/s")
for path, hs in zip(sys.argv[1:], (64, 128)):
    try:
        rows = json.load(open(path))["rows"]
    except (OSError, ValueError, KeyError) as e:
        print(f"FAIL head size {hs}: no results ({e})")
        ok = False
        continue
    seen = set()
    for r in rows:
        if not r["kernel"].startswith("attention_"):
            continue
        seen.add((r["kernel"], r["dtype"]))
        py = r.get("pytorch_ms")
        sp = r.get("speedup_vs_pytorch")
        print(f"{r['kernel']:<28} {r['dtype']:<5} {hs:>4} {r['ms'] * 1e3:>9.1f} "
              f"{py * 1e3 if py else float('nan'):>9.1f} {sp if sp else float('nan'):>9.2f}  "
              f"{r['achieved']:.0f} ({r['ceiling']} ceiling)")
    want = {(k, d) for k in ("attention_forward", "attention_backward", "attention_forward+backward")
            for d in ("bf16", "f16")}
    missing = sorted(want - seen)
    if missing:
        print(f"FAIL head size {hs}: no timing for {missing}")
        ok = False
    else:
        print(f"PASS head size {hs}: bf16 and f16 attention timed")
sys.exit(0 if ok else 1)
PY
[ $? = 0 ] || fail=1

echo "== 3. GPT-2 small, $STEPS steps, fp16-mixed and bf16-mixed (8 x 1024)"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.micro_batch=8 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.eval_batches=1 optim.warmup_steps=10 train.steps=$STEPS"
for p in fp16-mixed bf16-mixed; do
  rm -rf "$O/gpt2_$p"
  timeout 150 "$K" train --profile none --device cuda -q --out "$O/gpt2_$p" $GPT2 train.precision=$p \
    >"$O/gpt2_$p.log" 2>&1 || { bad "GPT-2 $p training exited $? (log $O/gpt2_$p.log)"; tail -3 "$O/gpt2_$p.log"; }
done
python3 - "$O/gpt2_fp16-mixed" "$O/gpt2_bf16-mixed" <<'PY'
import json, math, statistics, sys
speed = {}
ok = True
for d in sys.argv[1:]:
    name = d.rsplit("_", 1)[1]
    try:
        recs = [json.loads(l) for l in open(d + "/metrics.jsonl")]
    except OSError as e:
        print(f"FAIL GPT-2 {name}: no metrics ({e})")
        ok = False
        continue
    tr = [r for r in recs if r.get("kind") == "train"]
    late = [r["tokens_per_s"] for r in tr if r["step"] > 10]
    losses = [r["loss"] for r in tr if "loss" in r]
    if not late or not all(math.isfinite(l) for l in losses):
        print(f"FAIL GPT-2 {name}: {len(tr)} steps logged, losses {losses[:3]}..{losses[-3:]}")
        ok = False
        continue
    speed[name] = statistics.median(late)
    print(f"  GPT-2 {name}: median {speed[name] / 1e3:.1f}k tokens/s after step 10, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
if len(speed) == 2:
    r = speed["fp16-mixed"] / speed["bf16-mixed"]
    line = f"GPT-2 fp16-mixed at {r:.2f}x bf16-mixed's tokens/s (expected within 25%)"
    print(("PASS " if r >= 0.75 else "FAIL ") + line)
    ok &= r >= 0.75
sys.exit(0 if ok else 1)
PY
[ $? = 0 ] || fail=1

echo "== 4. Qwen3-0.6B-shaped Llama-family model (head size 128), 10 bf16-mixed steps"
QWEN3="model.kind=llama model.d_model=1024 model.n_layers=28 model.n_heads=16 model.n_kv_heads=8 model.head_dim=128 model.ffn_hidden=3072 model.qk_norm=true model.tied_head=true model.rope_theta=1000000 model.norm_eps=1e-6 model.vocab=151936 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=4 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.eval_batches=1 optim.warmup_steps=2 train.steps=10"
rm -rf "$O/qwen3"
if timeout 150 "$K" train --profile none --device cuda -q --out "$O/qwen3" $QWEN3 >"$O/qwen3.log" 2>&1 &&
  python3 - "$O/qwen3/metrics.jsonl" <<'PY'
import json, math, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
tr = [r for r in recs if r.get("kind") == "train"]
losses = [r["loss"] for r in tr if "loss" in r]
print(f"  losses: {[round(l, 3) for l in losses]}")
if tr:
    print(f"  median {statistics.median(r['tokens_per_s'] for r in tr[2:] or tr) / 1e3:.1f}k tokens/s, "
          f"peak {max(r.get('mem_peak', 0) for r in tr) / 2**30:.1f} GiB")
sys.exit(0 if len(losses) == 10 and all(math.isfinite(l) for l in losses) else 1)
PY
then pass "Qwen3-0.6B-shaped model trains 10 bf16-mixed steps with finite losses"
else bad "Qwen3-0.6B-shaped training (log $O/qwen3.log)"; tail -5 "$O/qwen3.log"; fi

echo "== done in $(( $(date +%s) - t0 )) s"
exit $fail
