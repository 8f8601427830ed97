#!/usr/bin/env bash
# The planner against real GPU steps, in one command from the repository root (about two
# minutes on an H100): for each shape, `kiln plan --json` on this GPU (every step planned by
# running it on a meta device) beside the pool peak a real
# `kiln train` of three steps measures (metrics.jsonl's mem_peak). PASS when the plan is
# within 0.5% of the measured peak.
#
#   KILN=target/release/kiln OUT=/some/dir bench/meta_plan_gpu_check.sh
set -uo pipefail
KILN=${KILN:-target/release/kiln}
LOG=${OUT:-$(mktemp -d)}/meta_plan
mkdir -p "$LOG"
failed=0
COMMON="train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.eval_batches=1 train.steps=3 data.tokenizer=gpt2"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 train.precision=bf16-mixed"
BK="model.kind=resnet_bk model.d_model=256 model.n_layers=4 model.context=1024 train.seq_len=1024 train.precision=bf16-mixed"
SMOL="model.kind=llama model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.ffn_hidden=1536 model.context=1024 train.seq_len=1024 train.precision=bf16-mixed"
L1B="model.kind=llama model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 train.seq_len=1024 train.precision=bf16-mixed"
printf '%-34s %14s %14s %9s\n' shape planned measured diff
check() { # check NAME OVERRIDES...
  local name=$1
  shift
  "$KILN" plan --json "$@" >"$LOG/$name.plan.json" 2>"$LOG/$name.plan.txt"
  local planned
  planned=$(python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
print(d["plan"]["pool_peak"] if "plan" in d else d["pool_peak"])' "$LOG/$name.plan.json" 2>/dev/null)
  rm -rf "$LOG/run-$name"
  timeout 200 "$KILN" train --device cuda --out "$LOG/run-$name" "$@" >"$LOG/$name.train.txt" 2>&1
  local measured
  measured=$(python3 -c '
import json, sys
peaks = [json.loads(l).get("mem_peak", 0) for l in open(sys.argv[1])]
print(max(peaks))' "$LOG/run-$name/metrics.jsonl" 2>/dev/null)
  if [ -z "$planned" ] || [ -z "$measured" ]; then
    echo "FAIL $name (no plan or no run; logs in $LOG/$name.*)"
    failed=1
    return
  fi
  python3 - "$name" "$planned" "$measured" <<'EOF'
import sys
name, p, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = (p - m) / m
print(f"{name:<34} {p / 2**30:11.3f} GiB {m / 2**30:11.3f} GiB {100 * d:+8.3f}%")
print(("PASS" if abs(d) <= 0.005 else "FAIL") + f" {name} within 0.5%")
sys.exit(0 if abs(d) <= 0.005 else 1)
EOF
  [ $? = 0 ] || failed=1
}
for mb in 4 8 16; do
  check "gpt2-small-mb$mb" $COMMON $GPT2 train.micro_batch=$mb
done
check "gpt2-small-mb8-recompute" $COMMON $GPT2 train.micro_batch=8 train.recompute=blocks
# f32 activations: attention runs as batched GEMMs keeping P per layer.
check "gpt2-small-mb8-tf32" $COMMON $GPT2 train.micro_batch=8 train.precision=tf32
check "resnet-bk-mb8" $COMMON $BK train.micro_batch=8
check "smollm2-135m-mb16" $COMMON $SMOL train.micro_batch=16
check "smollm2-135m-mb8-recompute" $COMMON $SMOL train.micro_batch=8 train.recompute=blocks
check "llama-3.2-1b-mb4" $COMMON $L1B train.micro_batch=4
t0=$(date +%s.%N)
"$KILN" plan --gpu h100-80gb model.d_model=1600 model.n_layers=48 model.n_heads=25 model.kind=llama model.context=1024 train.seq_len=1024 >/dev/null 2>&1
time_plan=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$t0" "$(date +%s.%N)")
echo "a 1.5B-parameter Llama-shaped step planned in $time_plan s"
echo
if [ $failed = 0 ]; then echo "ALL PASS"; else echo "SOME FAILED"; fi
exit $failed
