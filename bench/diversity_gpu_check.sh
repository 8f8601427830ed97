#!/usr/bin/env bash
# Pairwise cosine diversity on the GPU, in one command from the repository root:
#   1. `kiln selftest --only diversity`: the CUDA forward (D, the column sums, the row norms)
#      and gradient against the f64 CPU reference, f32 and bf16, five shapes from 1x8x64 to
#      1x4096x1024 (random and clustered sets, NaN-poisoned outputs), and n = 1 refused;
#   2. `kiln bench kernels --only diversity`: forward and gradient for n in 8..4096 and d in
#      64..1024 beside PyTorch's F.normalize + u @ u.T + upper-triangle mean (and its autograd
#      backward) in the same command; PASS when every size was timed on both sides, and a
#      second line when kiln is faster than PyTorch at n = 4096, d = 1024;
#   3. `kiln diversity --embedder all-MiniLM-L6-v2` on the GPU against the CPU, and against
#      sentence-transformers' embeddings with the same D computed in PyTorch.
#
#   KILN=target/release/kiln OUT=/some/dir bench/diversity_gpu_check.sh
# Needs the MiniLM fixture under .cache/fixtures/all-minilm-l6-v2 (scripts/fetch-fixtures.sh).
# Prints PASS/FAIL lines and the numbers; exits 1 if any check failed. Logs go under $OUT
# (a temporary directory when unset).
set -uo pipefail
KILN=${KILN:-target/release/kiln}
LOG=${OUT:-$(mktemp -d)}/diversity
MINILM=${MINILM:-.cache/fixtures/all-minilm-l6-v2}
mkdir -p "$LOG"
failed=0
report() { # report NAME STATUS DETAIL
  if [ "$2" = 0 ]; then echo "PASS $1 $3"; else echo "FAIL $1 $3"; failed=1; fi
}
[ -x "$KILN" ] || { echo "FAIL $KILN is not an executable kiln binary (set KILN)"; exit 1; }

echo "== 1. CUDA kernels against the CPU reference (kiln selftest --only diversity)"
timeout 150 "$KILN" selftest --only diversity >"$LOG/selftest.txt" 2>&1
rc=$?
grep -E "^(device|diversity|kernel )" "$LOG/selftest.txt"
grep -q "^selftest skipped" "$LOG/selftest.txt" && rc=1
report "selftest-diversity" $rc "($(grep -c '^diversity.*PASS$' "$LOG/selftest.txt") checks passed, $(grep -c '^diversity.*FAIL$' "$LOG/selftest.txt") failed; log $LOG/selftest.txt)"

echo "== 2. forward and gradient beside PyTorch (kiln bench kernels --only diversity)"
timeout 200 "$KILN" bench kernels --only diversity --dtypes f32,bf16 --out "$LOG/bench" \
  >"$LOG/bench.txt" 2>&1
rc=$?
grep -E "^(device|ceilings)" "$LOG/bench.txt"
python3 - "$LOG/bench/results.json" <<'PY' || rc=1
import json, sys
rows = [x for x in json.load(open(sys.argv[1]))["rows"] if x["group"] == "diversity"]
print(f"{'kernel':<26} {'dtype':<5} {'n':>5} {'kiln us':>9} {'GB/s':>7} {'PyTorch us':>11} {'speedup':>8}")
for x in rows:
    py = x.get("pytorch_ms")
    print(f"{x['kernel']:<26} {x['dtype']:<5} {x['size']:>5} {x['ms'] * 1e3:>9.1f} "
          f"{x['achieved']:>7.0f} {py * 1e3 if py else float('nan'):>11.1f} "
          f"{x.get('speedup_vs_pytorch') or float('nan'):>7.1f}x")
missing = [f"{x['kernel']} {x['dtype']} n{x['size']}" for x in rows if not x.get("pytorch_ms")]
if missing:
    print("no PyTorch time for: " + ", ".join(missing))
sys.exit(0 if len(rows) == 48 and not missing else 1)
PY
report "bench-diversity" $rc "(48 timings with PyTorch beside; report $LOG/bench/report.md)"
python3 - "$LOG/bench/results.json" <<'PY'
import json, sys
rows = [x for x in json.load(open(sys.argv[1]))["rows"] if x["group"] == "diversity"]
big = [x for x in rows if x["size"] == 4096 and x["kernel"].endswith("d1024")]
ok = big and all((x.get("speedup_vs_pytorch") or 0) > 1 for x in big)
detail = ", ".join(f"{x['kernel'].split()[0]} {x['dtype']} {x.get('speedup_vs_pytorch') or 0:.1f}x" for x in big)
print(f"{'PASS' if ok else 'FAIL'} diversity-faster-than-pytorch-at-4096x1024 ({detail})")
PY

echo "== 3. semantic diversity through MiniLM: GPU against CPU and sentence-transformers"
python3 - "$LOG/samples.jsonl" <<'PY'
import json, sys
lines = [
    ("Speak of love.", ["I love thee, I love thee well"] * 3 + ["My love is as a fever"]),
    ("Speak of war.", ["Cry havoc and let slip the dogs of war",
                       "The winter of our discontent is here",
                       "Once more unto the breach, dear friends",
                       "Now is the time to take up arms"]),
    ("Speak of the sea.", ["Full fathom five thy father lies",
                           "The sea is calm tonight",
                           "A ship is sailing on the sea",
                           "Waves break upon the shore"]),
]
with open(sys.argv[1], "w") as f:
    for p, s in lines:
        f.write(json.dumps({"prompt": p, "samples": [{"text": t} for t in s]}) + "\n")
PY
rc=0
for dev in cpu cuda; do
  timeout 120 "$KILN" diversity "$LOG/samples.jsonl" --embedder "$MINILM" --device $dev \
    --out "$LOG/metrics-$dev.json" >"$LOG/diversity-$dev.txt" 2>&1 || rc=1
  cat "$LOG/diversity-$dev.txt"
done
python3 - "$LOG" "$MINILM" <<'PY' || rc=1
import json, sys, torch, torch.nn.functional as F
log, minilm = sys.argv[1], sys.argv[2]
cpu = json.load(open(f"{log}/metrics-cpu.json"))["semantic_diversity_per_prompt"]
gpu = json.load(open(f"{log}/metrics-cuda.json"))["semantic_diversity_per_prompt"]
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(minilm, device="cuda")
ref = []
for line in open(f"{log}/samples.jsonl"):
    texts = [s["text"] for s in json.loads(line)["samples"]]
    e = model.encode(texts, convert_to_tensor=True).float()
    u = F.normalize(e, dim=-1)
    n = len(texts)
    ref.append(float(1 - (u @ u.T).triu(1).sum() / (n * (n - 1) / 2)))
print(f"{'prompt':>6} {'kiln cpu':>10} {'kiln cuda':>10} {'sentence-transformers':>22}")
for i, (c, g, r) in enumerate(zip(cpu, gpu, ref)):
    print(f"{i + 1:>6} {c:>10.5f} {g:>10.5f} {r:>22.5f}")
worst_dev = max(abs(c - g) for c, g in zip(cpu, gpu))
worst_ref = max(abs(c - r) for c, r in zip(cpu, ref))
print(f"max |cpu - cuda| {worst_dev:.2e} (bound 1e-4), max |kiln - sentence-transformers| {worst_ref:.2e} (bound 2e-3)")
sys.exit(0 if worst_dev < 1e-4 and worst_ref < 2e-3 else 1)
PY
report "semantic-diversity" $rc "(logs $LOG/diversity-*.txt)"

exit $failed
