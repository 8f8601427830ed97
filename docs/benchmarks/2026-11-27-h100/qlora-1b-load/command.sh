#!/usr/bin/env bash
# 1. A QLoRA fine-tune's wall time from a random Llama-3.2-1B-shaped directory (f32 safetensors),
#    earlier binary vs this build (NF4's finite check in chunks; projections left on the host),
#    with the GPU's memory in use sampled every 50 ms.
# 2. A GPT run on the built-in gpt2 tokenizer, exported: transformers' AutoTokenizer reads the
#    written tokenizer.json and gives kiln's ids.
set -u
O=$OUT
gunzip -c gpubin/kiln-new.gz > /tmp/kiln-new; gunzip -c gpubin/kiln-base.gz > /tmp/kiln-base; chmod +x /tmp/kiln-new /tmp/kiln-base
zcat data/shakespeare.txt.gz > /tmp/corpus.txt
/tmp/kiln-new selftest --only nf4 2>&1 | tail -1
/tmp/kiln-base selftest --only nf4 2>&1 | tail -1
t0=$(date +%s)
python3 -c "
import sys; sys.path.insert(0, 'bench'); import llama_parity as p
p.save(p.configs()[0][1], '/tmp/l1b', 'gpubin/tok')" > $O/save1b.txt 2>&1 || tail -3 $O/save1b.txt
echo "saved the 1B directory in $(( $(date +%s) - t0 )) s"
for b in new base; do
  rm -rf /tmp/q$b
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > /tmp/mem-$b.txt &
  smi=$!
  t0=$(date +%s.%N)
  /tmp/kiln-$b finetune --init-from /tmp/l1b --data /tmp/corpus.txt --out /tmp/q$b --device cuda -q --qlora \
    train.precision=bf16-mixed train.seq_len=128 train.micro_batch=1 train.steps=3 train.log_every=1 train.eval_every=0 > $O/q1b-$b.txt 2>&1
  rc=$?; t1=$(date +%s.%N); kill $smi; sleep 0.2
  echo "$b: exit $rc, $(python3 -c "print(round($t1-$t0,1))") s, device memory used max $(sort -n /tmp/mem-$b.txt | tail -1) MiB"
  python3 -c "
import json; r=[json.loads(l) for l in open('/tmp/q$b/metrics.jsonl')]
print('  losses', [x['loss'] for x in r if x.get('kind')=='train'])"
done
echo "=== exported gpt2 tokenizer in transformers"
/tmp/kiln-new train -q --device cuda --out /tmp/g2run model.d_model=64 model.n_layers=1 model.n_heads=2 model.context=64 train.seq_len=64 train.steps=2 train.eval_every=0 data.tokenizer=gpt2 > /dev/null 2>&1
/tmp/kiln-new export --run /tmp/g2run --to /tmp/g2hf 2>&1 | tail -1
head -c 100000 /tmp/corpus.txt > /tmp/sample.txt
printf "I'm sure they'll've done it   twice.\tNumbers: 12345 3.14159!!!\n caf\xc3\xa9 na\xc3\xafve \xe6\x9d\xb1\xe4\xba\xac \xf0\x9f\x91\xa9\n" >> /tmp/sample.txt
/tmp/kiln-new tokenize --tokenizer gpt2 --input /tmp/sample.txt > /tmp/kiln-ids.jsonl
python3 - <<'PY'
import json, transformers as tf
tok = tf.AutoTokenizer.from_pretrained("/tmp/g2hf")
lines = open("/tmp/sample.txt", encoding="utf-8").read().split("\n")
kiln = [json.loads(l) for l in open("/tmp/kiln-ids.jsonl")]
same = sum(1 for a, b in zip(lines, kiln) if tok(a, add_special_tokens=False)["input_ids"] == b)
print(json.dumps({"check": "AutoTokenizer on the exported gpt2 tokenizer.json vs kiln's gpt2 ids",
                  "class": type(tok).__name__, "lines": len(kiln), "identical": same,
                  "eos": tok.eos_token, "eos_id": tok.eos_token_id, "pass": same == len(kiln)}))
PY
