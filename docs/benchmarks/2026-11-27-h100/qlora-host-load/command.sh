#!/usr/bin/env bash
set -u
O=$OUT
[ -x /tmp/kiln-new ] || { gunzip -c gpubin/kiln-new.gz > /tmp/kiln-new; gunzip -c gpubin/kiln-base.gz > /tmp/kiln-base; chmod +x /tmp/kiln-new /tmp/kiln-base; }
echo "=== GPT-2 LoRA / QLoRA"
KILN=/tmp/kiln-new OUT=/tmp/g2 timeout 300 bash bench/gpt2_lora_gpu_check.sh gpubin/tok 2>&1 | grep -v "Loading weights" | tee $O/gpt2_lora.txt
mkdir -p $O/gpt2; for f in /tmp/g2/*.txt /tmp/g2/parity.jsonl /tmp/g2/replies.jsonl /tmp/g2/ft/adapter/adapter_config.json; do cp $f $O/gpt2/; done
echo "=== QLoRA load: device memory (nvidia-smi every 50 ms), SmolLM2-135M shape (random)"
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[1][1], '/tmp/smol', 'gpubin/tok')" > $O/save.txt 2>&1 || tail -3 $O/save.txt
zcat data/shakespeare.txt.gz > /tmp/corpus.txt
for b in base new new; do
  rm -rf /tmp/q$b
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > /tmp/mem-$b.txt &
  smi=$!
  t0=$(date +%s.%N)
  /tmp/kiln-$b finetune --init-from /tmp/smol --data /tmp/corpus.txt --out /tmp/q$b --device cuda -q --qlora \
    train.precision=bf16-mixed train.seq_len=128 train.micro_batch=1 train.steps=3 train.log_every=1 train.eval_every=0 > $O/qsmol-$b.txt 2>&1
  rc=$?; t1=$(date +%s.%N); kill $smi; sleep 0.2
  echo "$b: exit $rc, $(python3 -c "print(round($t1-$t0,1))") s, device memory used max $(sort -n /tmp/mem-$b.txt | tail -1) MiB, idle $(head -1 /tmp/mem-$b.txt) MiB"
  python3 -c "
import json; r=[json.loads(l) for l in open('/tmp/q$b/metrics.jsonl')]
print('  losses', [x['loss'] for x in r if x.get('kind')=='train'])"
  cp /tmp/q$b/checkpoints/step_0000003/model.safetensors /tmp/ck-$b-$RANDOM.st
done
ls /tmp/ck-*; md5sum /tmp/ck-*
