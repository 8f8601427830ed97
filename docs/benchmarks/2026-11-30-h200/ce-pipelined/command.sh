#!/usr/bin/env bash
# The pipelined cross-entropy (cross_entropy_pipelined) against the clustered kernel, one
# binary (KILN_CE_PIPELINED=0 takes the clustered kernel). Part 1: the selftest's cross-entropy
# checks both ways (same seed: identical errors mean identical outputs) and `kiln bench kernels
# --only memory` at GPT-2 small's and Llama 3's vocabularies, alternating. Part 2: training,
# GPT-2 small bf16-mixed 16 x 1024 and the Llama-3.2-1B shape 8 x 1024, alternating; every
# logged loss should be the same both ways.
set -u
part=$1
R=/tmp/r; mkdir -p $R
s=$(date +%s)
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln
K=/tmp/kiln
if [ "$part" = 1 ]; then
  for p in 1 0; do
    KILN_CE_PIPELINED=$p timeout 240 $K selftest --only kernels --match cross_entropy > $R/selftest-p$p.log 2>&1; echo "selftest p$p rc $? t=$(( $(date +%s)-s ))"
  done
  grep -hE "checks,|FAIL" $R/selftest-p*.log | head
  diff <(grep -E "PASS|FAIL" $R/selftest-p0.log) <(grep -E "PASS|FAIL" $R/selftest-p1.log) > $R/selftest-diff.txt; echo "check lines differing: $(grep -c '^<' $R/selftest-diff.txt) of $(grep -cE 'PASS|FAIL' $R/selftest-p1.log)"
  for round in 1 2; do
    order="1 0"; [ $round = 2 ] && order="0 1"
    for p in $order; do
      tag=gpt2-p$p-r$round
      KILN_CE_PIPELINED=$p timeout 150 $K bench kernels --only memory --dtypes bf16 --rows 16384 --no-python --out $R/$tag > $R/$tag.log 2>&1
      echo "$tag rc $? t=$(( $(date +%s)-s )) $(grep -E '^cross_entropy_fused ' $R/$tag.log | head -1)"
    done
    for p in $order; do
      tag=llama-p$p-r$round
      KILN_CE_PIPELINED=$p timeout 150 $K bench kernels --only memory --dtypes bf16 --rows 8192 --channels 2048 --heads 32 --vocab 128256 --no-python --out $R/$tag > $R/$tag.log 2>&1
      echo "$tag rc $? t=$(( $(date +%s)-s )) $(grep -E '^cross_entropy_fused ' $R/$tag.log | head -1)"
    done
  done
elif [ "$part" = grid ]; then
  # The grid from the driver's occupancy query (default) against fixed cluster counts.
  timeout 240 $K selftest --only kernels --match cross_entropy > $R/selftest-grid.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"; grep -hE "checks,|FAIL" $R/selftest-grid.log | head -3
  for c in default p0 66 100 132 200 default p0; do
    tag=gpt2-grid-$c-$(date +%s)
    case $c in default) env="";; p0) env="KILN_CE_PIPELINED=0";; *) env="KILN_CE_CLUSTERS=$c";; esac
    env $env timeout 150 $K bench kernels --only memory --dtypes bf16 --rows 16384 --no-python --out $R/$tag > $R/$tag.log 2>&1
    echo "$tag rc $? $(grep -E '^cross_entropy_fused ' $R/$tag.log | head -1)"
  done
  for c in default p0 default p0; do
    tag=llama-grid-$c-$(date +%s)
    case $c in default) env="";; p0) env="KILN_CE_PIPELINED=0";; esac
    env $env timeout 150 $K bench kernels --only memory --dtypes bf16 --rows 8192 --channels 2048 --heads 32 --vocab 128256 --no-python --out $R/$tag > $R/$tag.log 2>&1
    echo "$tag rc $? $(grep -E '^cross_entropy_fused ' $R/$tag.log | head -1)"
  done
else
  common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
  GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16 train.steps=30"
  L1B="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2 train.micro_batch=8 train.steps=14"
  med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>$2]
print(round(statistics.median(x['tokens_per_s'] for x in t)))"; }
  for p in 1 0 0 1; do
    tag=gpt2-p$p-$(date +%s)
    KILN_CE_PIPELINED=$p timeout 100 $K train --device cuda --out $R/$tag -q --profile none $common $GPT2 > $R/$tag.log 2>&1
    echo "$tag rc $? t=$(( $(date +%s)-s )) tokens/s $(med $R/$tag 10)"
    python3 gpubin/losses.py $R/$tag/metrics.jsonl > $R/$tag.losses
  done
  echo "gpt2 distinct loss sequences: $(cat $R/gpt2-*.losses | sort -u | wc -l) (of $(ls $R/gpt2-*.losses | wc -l) runs), $(wc -w < $(ls $R/gpt2-*.losses | head -1)) losses each"
  for p in 1 0; do
    tag=l1b-p$p-$(date +%s)
    KILN_CE_PIPELINED=$p timeout 120 $K train --device cuda --out $R/$tag -q --profile none $common $L1B > $R/$tag.log 2>&1
    echo "$tag rc $? t=$(( $(date +%s)-s )) tokens/s $(med $R/$tag 5)"
    python3 gpubin/losses.py $R/$tag/metrics.jsonl > $R/$tag.losses
  done
  echo "l1b distinct loss sequences: $(cat $R/l1b-*.losses | sort -u | wc -l) (of $(ls $R/l1b-*.losses | wc -l) runs)"
fi
rm -rf $R/*/checkpoints
tar czf $OUT/logs-$part.tgz -C $R . 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
