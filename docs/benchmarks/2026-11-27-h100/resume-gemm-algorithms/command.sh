#!/usr/bin/env bash
# Bit-exact resume on a GPU: a QLoRA run of a random SmolLM2-135M-shaped model (micro-batch 1 x 128,
# whose products are timed as skinny ones) checkpoints at steps 2 and 4; a copy resumed from step 2
# must write the same step-4 checkpoint. Three trials each for the earlier binary (no algorithm
# table) and this build (the checkpoint's table adopted).
set -u
O=$OUT
gunzip -c gpubin/kiln-new.gz > /tmp/kiln-new; gunzip -c gpubin/kiln-base.gz > /tmp/kiln-base; chmod +x /tmp/kiln-new /tmp/kiln-base
[ -d /tmp/smol ] || python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[1][1], '/tmp/smol', 'gpubin/tok')" > $O/save.txt 2>&1
zcat data/shakespeare.txt.gz > /tmp/corpus.txt
for b in base new; do
  for t in 1 2 3; do
    R=/tmp/r-$b-$t; rm -rf $R $R-resumed
    /tmp/kiln-$b finetune --init-from /tmp/smol --data /tmp/corpus.txt --out $R --device cuda -q --qlora \
      train.precision=bf16-mixed train.seq_len=128 train.micro_batch=1 train.steps=4 train.checkpoint_every=2 \
      train.eval_every=0 train.log_every=1 > $O/run-$b-$t.txt 2>&1 || { echo "$b $t: run failed"; tail -3 $O/run-$b-$t.txt; continue; }
    cp -r $R $R-resumed; rm -rf $R-resumed/checkpoints/step_0000004
    /tmp/kiln-$b finetune --resume $R-resumed --checkpoint step_2 --device cuda -q > $O/resume-$b-$t.txt 2>&1 \
      || { echo "$b $t: resume failed"; tail -3 $O/resume-$b-$t.txt; continue; }
    same=yes
    for f in model.safetensors optimizer.safetensors; do
      cmp -s $R/checkpoints/step_0000004/$f $R-resumed/checkpoints/step_0000004/$f || same=no
    done
    echo "$b trial $t: step-4 checkpoint of the resumed copy identical: $same"
  done
done
python3 -c "
import json; m=json.load(open('/tmp/r-new-1/checkpoints/step_0000004/trainer.json'))
g=m.get('gemm_algorithms'); print('table:', g['gpu'], 'cuBLASLt', g['cublaslt'], len(g['table']), 'shapes')"
grep -h "note:" $O/resume-new-*.txt | sort | uniq -c
