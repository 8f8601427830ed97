#!/usr/bin/env bash
# Training with the TMA attention (default) and without (KILN_ATTENTION_TMA=0), one binary:
# GPT-2 small bf16-mixed 8 x 1024 (head size 64, TMA forward and backward) and the same width
# with 6 heads (head size 128, TMA forward); every step's loss (metrics.jsonl, full precision)
# should be identical, and tokens/s shows the step's change.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln
K=/tmp/kiln
COMMON="model.d_model=768 model.n_layers=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=8 train.steps=60 train.log_every=10 train.eval_every=1000 train.checkpoint_every=1000 train.save_final=false"
for heads in 12 6; do
  for tma in 1 0 1 0; do
    tag=h$heads-tma$tma-$(date +%s)
    KILN_ATTENTION_TMA=$tma timeout 120 $K train --profile none --device cuda --out $R/$tag $COMMON model.n_heads=$heads > $R/$tag.log 2>&1
    echo "$tag rc $? t=$(( $(date +%s)-s )) $(grep -E '^step +60/' $R/$tag.log | grep -oE '[0-9.]+k tok/s')"
    python3 docs/benchmarks/2026-11-30-h200/attention-tma/training/losses.py $R/$tag/metrics.jsonl > $R/$tag.losses
    [ "$heads$tma" = 121 ] && [ ! -f $R/first-done ] && { grep -E "^step" $R/$tag.log | head -3; touch $R/first-done; }
  done
  echo "h$heads distinct loss sequences: $(cat $R/h$heads-*.losses | sort -u | wc -l) (of $(ls $R/h$heads-*.losses | wc -l) runs), $(wc -w < $(ls $R/h$heads-*.losses | head -1)) losses each"
done
rm -rf $R/*/checkpoints
tar czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
