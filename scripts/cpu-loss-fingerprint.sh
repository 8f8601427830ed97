#!/usr/bin/env bash
# Short CPU training runs of every language-model family and step variant, reduced to their
# per-step losses: run it with one build, then another, and compare the outputs to check that
# a change leaves training bit for bit as it was.
#
#   scripts/cpu-loss-fingerprint.sh target/release/kiln /tmp/losses-a
#   scripts/cpu-loss-fingerprint.sh target/release/kiln /tmp/losses-b
#   diff -r /tmp/losses-a /tmp/losses-b && echo identical
set -euo pipefail
kiln=${1:?usage: $0 KILN_BINARY OUT_DIR}
out=${2:?usage: $0 KILN_BINARY OUT_DIR}
mkdir -p "$out"
common=(train.steps=20 train.log_every=1 model.d_model=64 model.n_layers=2 model.n_heads=2
    train.seq_len=64 model.context=64)
declare -A runs=(
    [gpt]=""
    [gpt_untied]="model.tied_head=false"
    [gpt_recompute]="train.recompute=blocks"
    [gpt_unfused]="train.fused_kernels=false"
    [gpt_bf16]="train.precision=bf16-mixed"
    [resnet_bk]="model.kind=resnet_bk"
    [resnet_bk_top1]="model.kind=resnet_bk model.moe_top_k=1 model.tied_head=false"
    [resnet_bk_recompute]="model.kind=resnet_bk train.recompute=blocks"
    [llama]="model.kind=llama model.n_kv_heads=1 model.ffn_hidden=128"
    [llama_recompute]="model.kind=llama model.n_kv_heads=1 model.ffn_hidden=128 train.recompute=blocks"
    [llama_bf16]="model.kind=llama model.n_kv_heads=1 model.ffn_hidden=128 train.precision=bf16-mixed"
)
for name in "${!runs[@]}"; do
    dir=$(mktemp -d)
    # shellcheck disable=SC2086
    if "$kiln" train --profile none --device cpu -q --out "$dir" "${common[@]}" ${runs[$name]} \
        >"$dir/log" 2>&1; then
        # Only the losses: timings differ from run to run.
        grep -o '"\(loss\|val_loss\)":[^,}]*' "$dir/metrics.jsonl" >"$out/$name"
    else
        echo "failed: $(tail -n 3 "$dir/log")" >"$out/$name"
    fi
    rm -rf "$dir"
done
ls "$out"
