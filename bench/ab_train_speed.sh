#!/usr/bin/env bash
# Two kiln binaries side by side on one GPU: GPT-2 small (bf16-mixed, micro-batch 8 x 1024,
# 60 steps) trained by each in turn, ROUNDS times, alternating so that clock and thermal drift
# fall on both; prints each run's median tokens/s after warm-up (bench/dist_compare.py) and
# the median of each binary's medians. Losses must be identical between the binaries when the
# change is meant to keep training bit for bit.
#
#   OUT=/tmp/ab bench/ab_train_speed.sh OLD_KILN NEW_KILN
set -uo pipefail
A=${1:?usage: $0 OLD_KILN NEW_KILN}
B=${2:?usage: $0 OLD_KILN NEW_KILN}
O=${OUT:-/tmp/kiln-ab}
ROUNDS=${ROUNDS:-3}
mkdir -p "$O"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=8 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.eval_batches=2 optim.warmup_steps=10 optim.lr=6e-4 optim.min_lr=6e-5 train.steps=60 train.save_final=false"
for r in $(seq 1 "$ROUNDS"); do
  for which in old new; do
    bin=$A; [ "$which" = new ] && bin=$B
    # shellcheck disable=SC2086
    "$bin" train --profile none -q --device cuda --out "$O/$which$r" $GPT2 >"$O/$which$r.log" 2>&1 ||
      { echo "FAIL $which round $r: $(tail -n 3 "$O/$which$r.log")"; exit 1; }
  done
done
python3 - "$O" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def run(d):
    steps = [json.loads(l) for l in open(f"{out}/{d}/metrics.jsonl") if '"kind":"train"' in l]
    rates = [s["tokens_per_s"] for s in steps if s["step"] > 5]
    return statistics.median(rates), [s["loss"] for s in steps]
med = {}
for w in ("old", "new"):
    med[w] = []
    for r in range(1, rounds + 1):
        m, losses = run(f"{w}{r}")
        med[w].append(m)
        print(f"{w} round {r}: median {m:.0f} tok/s, last loss {losses[-1]:.6f}")
old, new = statistics.median(med["old"]), statistics.median(med["new"])
print(f"old {old:.0f} tok/s, new {new:.0f} tok/s: new / old = {new / old:.4f}")
same = all(run(f"old{r}")[1] == run(f"new{r}")[1] for r in range(1, rounds + 1))
print("losses identical between the binaries" if same else "losses differ between the binaries")
PY
