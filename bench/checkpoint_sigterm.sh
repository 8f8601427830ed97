#!/usr/bin/env bash
# On a GPU: how long a checkpoint of GPT-2 small stalls training (the "checkpoint" records of
# metrics.jsonl: snapshot_s blocks the step, write_s runs in the background), and a run
# stopped by SIGTERM (exit 75), resumed, against a run never stopped, file by file.
#
#   bench/checkpoint_sigterm.sh KILN
set -uo pipefail
K=$1 W=${WORK:-/tmp/kiln-ckpt}
rm -rf "$W" && mkdir -p "$W"
common="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.seq_len=1024 train.micro_batch=8 train.precision=bf16-mixed train.eval_every=0 train.log_every=10"
"$K" train --device cuda --out "$W/st" -q $common train.steps=30 train.checkpoint_every=10 | tail -2
grep '"checkpoint"' "$W/st/metrics.jsonl"
"$K" train --device cuda --out "$W/full" -q $common train.steps=300 train.checkpoint_every=150 | tail -1
"$K" train --device cuda --out "$W/sig" -q $common train.steps=300 train.checkpoint_every=150 &
pid=$!; sleep 6; kill -TERM $pid; wait $pid; echo "SIGTERM run exit $?"
"$K" train --resume "$W/sig" -q | tail -1
for f in model.safetensors optimizer.safetensors; do
  cmp "$W/full/checkpoints/step_0000300/$f" "$W/sig/checkpoints/step_0000300/$f" && echo "$f bit-identical"
done
