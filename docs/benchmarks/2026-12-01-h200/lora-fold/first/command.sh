#!/usr/bin/env bash
# LoRA adapters folded into their frozen products (query/key/value and gate/up, fed by the
# RMSNorms that now write their rows R columns wider) against the adapters apart
# (KILN_LORA_FOLD=0), one binary both ways: the norms' selftest checks (strided rows), then
# LoRA rank 16 on all linear layers at the Llama-3.2-1B shape (8 x 1024) and the SmolLM2-135M
# shape (16 x 1024), bf16-mixed, the two ways in turn twice, and a trace of each way at the 1B
# shape split by op.
set -u
xz -dc gpubin/kiln-new.xz > /tmp/kiln; chmod +x /tmp/kiln
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
/tmp/kiln selftest --only kernels --match rmsnorm,layernorm 2>&1 | grep -E "norm|checks" | tail -40
echo "selftest t=$(( $(date +%s)-s ))"
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5"
L1B="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2"
S135="model.kind=llama model.vocab=49152 model.d_model=576 model.n_layers=30 model.n_heads=9 model.n_kv_heads=3 model.head_dim=64 model.ffn_hidden=1536 model.context=1024 model.rope_theta=100000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpubin/tok/tokenizer.json"
LORA="lora.rank=16 lora.alpha=32 lora.targets=all-linear"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>$3]
m=statistics.median(x['tokens_per_s'] for x in t)
l=[x['loss'] for x in r if x.get('kind')=='train']
mem={k: v for k, v in t[-1].items() if 'mem' in k or 'peak' in k}
print('$2 median tokens/s', round(m), 'steps', len(t), 'ms/step', round($4*1e3/m, 2), 'losses', [round(v, 4) for v in l[:3]], '...', round(l[-1], 4), mem)"; }
gunzip -c data/shakespeare.txt.gz > /tmp/shakespeare.txt; D=/tmp/shakespeare.txt
for shape in l1b s135; do
  if [ $shape = l1b ]; then M="$L1B train.micro_batch=8"; tok=8192; else M="$S135 train.micro_batch=16"; tok=16384; fi
  timeout 120 /tmp/kiln train --device cuda --out /tmp/base-$shape -q --profile none $common $M train.steps=1 train.save_final=true > /dev/null 2>&1; echo "$shape base rc $?"
  timeout 120 /tmp/kiln export --run /tmp/base-$shape --to /tmp/basex-$shape > /dev/null 2>&1; echo "$shape export rc $? t=$(( $(date +%s)-s ))"
  for round in 1 2; do
    for f in 1 0; do
      o=/tmp/lora-$shape-$f-$round
      KILN_LORA_FOLD=$f timeout 150 /tmp/kiln finetune --device cuda --init-from /tmp/basex-$shape --data $D --out $o -q --profile none $common $LORA train.micro_batch=${M##*=} train.steps=24 train.save_final=false > $OUT/lora-$shape-fold$f-$round.log 2>&1; echo "$shape fold=$f round $round rc $? t=$(( $(date +%s)-s ))"; med $o "$shape fold=$f round $round" 5 $tok
      grep -iE "peak|memory" $OUT/lora-$shape-fold$f-$round.log | head -2
    done
  done
  [ $shape = l1b ] && for f in 1 0; do
    KILN_LORA_FOLD=$f timeout 150 /tmp/kiln finetune --device cuda --init-from /tmp/basex-$shape --data $D --out /tmp/lorat-$shape-$f -q --profile none $common $LORA train.micro_batch=${M##*=} train.steps=14 train.save_final=false --trace $OUT/lora-$shape-fold$f.json --trace-steps 12..=12 > /dev/null 2>&1; echo "$shape trace fold=$f rc $? t=$(( $(date +%s)-s ))"
    python3 bench/trace_gaps.py $OUT/lora-$shape-fold$f.json --by-op | grep -v 'host-bound gaps before' | head -12
  done
done
gzip -f $OUT/*.json
