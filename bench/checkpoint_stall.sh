#!/usr/bin/env bash
# On one GPU: how long a checkpoint stalls training, saved in line (train.checkpoint_async=false:
# the state is read back tensor by tensor through pageable memory and written while training
# waits) against the background writer (page-locked staging filled by queued copies and one
# synchronisation, written by a background thread). Two shapes in bf16-mixed: GPT-2 small
# (124M parameters, 1.5 GB checkpoints) and a 1.5B-parameter GPT of the GPT-2 XL shape
# (d_model 1600, 48 layers, 25 heads, context 1024; about 18.7 GB of weights and AdamW moments).
#
# Prints one row per save from the "checkpoint" records of metrics.jsonl (stall = training
# blocked: waiting for the previous write, whose staging the copy reuses, plus the copy, plus
# the write when in line), then PASS/FAIL lines: background saves used pinned staging; the
# in-line and background runs wrote identical checkpoints (their manifests' CRC-32s agree);
# the background stall is below the in-line one.
#
#   KILN=target/release/kiln OUT=/tmp/out bench/checkpoint_stall.sh
#
# XL_STEPS and XL_EVERY (default 2 and 1: two saves) and SMALL_STEPS and SMALL_EVERY (12 and
# 4) set the runs. An XL save in line takes about a minute (a GPT-2 small one took 4.5-5 s
# on an H100), so the XL runs come last and the in-line one is cut off at the time budget
# (BUDGET_S, default 285 s for the whole script), reporting the saves it finished.
# The XL runs need about 40 GB of free disk under WORK (two checkpoints are kept).
set -uo pipefail
KILN=${KILN:-target/release/kiln}
OUT=${OUT:-/tmp/kiln-stall-out}
WORK=${WORK:-/tmp/kiln-stall}
BUDGET_S=${BUDGET_S:-285}
SMALL_STEPS=${SMALL_STEPS:-12} SMALL_EVERY=${SMALL_EVERY:-4}
XL_STEPS=${XL_STEPS:-2} XL_EVERY=${XL_EVERY:-1}
mkdir -p "$OUT" && rm -rf "$WORK" && mkdir -p "$WORK"
start=$(date +%s)
common="data.tokenizer=gpt2 model.context=1024 train.seq_len=1024 train.precision=bf16-mixed train.offload_optimizer=false train.eval_every=0 train.eval_batches=1 train.log_every=1"
small="$common model.d_model=768 model.n_layers=12 model.n_heads=12 train.micro_batch=8"
xl="$common model.d_model=1600 model.n_layers=48 model.n_heads=25 train.micro_batch=4 train.recompute=blocks"

# run NAME MODE LIMIT_S SETTINGS...: trains into $WORK/NAME, keeps its metrics and manifests.
run() {
  local name=$1 mode=$2 limit=$3; shift 3
  local async=true; [ "$mode" = inline ] && async=false
  local t0=$(date +%s)
  # SIGKILL, not SIGTERM: a graceful stop would save one more checkpoint.
  timeout -s KILL "$limit" "$KILN" train --device cuda --out "$WORK/$name" "$@" \
    train.checkpoint_async=$async >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s (log $OUT/$name.log)"
  [ $rc -eq 137 ] && echo "$name: cut off at ${limit}s; the saves it finished are reported"
  cp "$WORK/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  for m in "$WORK/$name"/checkpoints/step_*/manifest.json; do
    [ -f "$m" ] && cp "$m" "$OUT/$name.$(basename "$(dirname "$m")").manifest.json"
  done
  rm -rf "$WORK/$name"
}
# Seconds of the budget left after reserving $1, at least 30.
left() { local l=$(( BUDGET_S - ($(date +%s) - start) - ${1:-0} )); [ $l -lt 30 ] && l=30; echo $l; }

run small-inline inline 120 $small train.steps=$SMALL_STEPS train.checkpoint_every=$SMALL_EVERY
run small-background background 120 $small train.steps=$SMALL_STEPS train.checkpoint_every=$SMALL_EVERY
# An XL checkpoint is about 18.7 GB and a run keeps two; with room for one, one save each.
free_gb=$(df -P -BG "$WORK" | awk 'NR==2 {gsub("G","",$4); print $4}')
if [ "${free_gb:-0}" -lt 40 ] && [ "${free_gb:-0}" -ge 21 ]; then
  echo "note: ${free_gb} GB free under $WORK, room for one XL checkpoint: one save per XL run"
  XL_STEPS=1 XL_EVERY=1
fi
if [ "${free_gb:-0}" -lt 21 ]; then
  echo "SKIP XL: ${free_gb} GB free under $WORK, an XL checkpoint needs about 19 GB (set WORK)"
else
  run xl-background background "$(left 70)" $xl train.steps=$XL_STEPS train.checkpoint_every=$XL_EVERY
  run xl-inline inline "$(left)" $xl train.steps=$XL_STEPS train.checkpoint_every=$XL_EVERY
fi

python3 - "$OUT" <<'EOF'
import glob, json, os, statistics, sys
out = sys.argv[1]

def saves(name):
    try:
        lines = open(os.path.join(out, name + ".metrics.jsonl")).read().splitlines()
    except OSError:
        return []
    return [r for r in map(json.loads, lines) if r.get("kind") == "checkpoint"]

def manifest(name, step):
    p = os.path.join(out, f"{name}.step_{step:07d}.manifest.json")
    if not os.path.exists(p):
        return None
    files = json.load(open(p))["files"]
    return {f["name"]: (f["bytes"], f["crc32"]) for f in files if f["name"].endswith(".safetensors")}

print()
print("| shape | mode | step | checkpoint | stall (training blocked) | of it: wait for previous write | copy to host | write | staging |")
print("|---|---|---|---|---|---|---|---|---|")
results = {}
for shape in ["small", "xl"]:
    for mode in ["inline", "background"]:
        rs = saves(f"{shape}-{mode}")
        results[(shape, mode)] = rs
        for r in rs:
            print(f"| {shape} | {mode} | {r['step']} | {r['bytes'] / 1e9:.2f} GB | {r['stall_s']:.3f} s | "
                  f"{r['wait_s']:.3f} s | {r['snapshot_s']:.3f} s | {r['write_s']:.2f} s | {r['staging']} |")
print()
verdicts = []
for shape in ["small", "xl"]:
    inline, background = results[(shape, "inline")], results[(shape, "background")]
    if not inline or not background:
        print(f"{shape}: not measured in both modes (see the logs)")
        continue
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    si, sb = med(inline, "stall_s"), med(background, "stall_s")
    cb = med(background, "snapshot_s")
    print(f"{shape}: median stall per save in line {si:.3f} s, background {sb:.3f} s "
          f"(copy alone {cb:.3f} s, {background[0]['bytes'] / cb / 1e9:.1f} GB/s); "
          f"median write in line {med(inline, 'write_s'):.2f} s, background {med(background, 'write_s'):.2f} s")
    pinned = all(r["staging"] == "pinned" for r in background)
    verdicts.append((pinned, f"{shape}: background saves copied through pinned staging"))
    verdicts.append((sb < si, f"{shape}: background stall {sb:.3f} s below in-line {si:.3f} s ({si / max(sb, 1e-9):.1f}x)"))
    steps = sorted({r["step"] for r in inline} & {r["step"] for r in background})
    same = [s for s in steps if manifest(f"{shape}-inline", s) is not None
            and manifest(f"{shape}-inline", s) == manifest(f"{shape}-background", s)]
    # Only the checkpoints both runs still kept can be compared (two are kept).
    kept = [s for s in steps if manifest(f"{shape}-inline", s) and manifest(f"{shape}-background", s)]
    verdicts.append((bool(kept) and same == kept,
                     f"{shape}: in-line and background checkpoints identical at steps {kept} (CRC-32 of model and optimizer files)"))
print()
for ok, what in verdicts:
    print(("PASS " if ok else "FAIL ") + what)
if not verdicts:
    print("FAIL nothing was measured")
EOF
echo "total $(( $(date +%s) - start )) s; logs and metrics under $OUT"
