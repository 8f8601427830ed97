#!/usr/bin/env bash
# Generation loading each matrix straight into bf16 (new) against the build before (old):
# random SmolLM2-135M- and Llama-3.2-1B-shaped directories (transformers), greedy, bf16 and fp32, and a random
# Llama-3.2-1B shape in bf16 only: the same tokens and log-probabilities, and each
# run's pool peak from its summary line.
set -u
for b in old new; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
python3 - <<'PY' > $OUT/save.txt 2>&1
import sys; sys.path.insert(0, "bench")
import llama_parity as lp
lp.save(lp.configs()[0][1], "/tmp/l1b", "gpubin/tok")
lp.save(lp.configs()[1][1], "/tmp/smol", "gpubin/tok")
PY
echo "save rc $?"
printf '{"prompt": "The quick brown fox"}\n{"prompt": "ROMEO: But soft"}\n' > /tmp/p.jsonl
for m in smol:/tmp/smol l1b:/tmp/l1b; do
  for prec in bf16 fp32; do
    [ ${m%%:*} = l1b ] && [ $prec = fp32 ] && continue
    for b in old new; do
      /tmp/kiln-$b generate --init-from ${m#*:} --prompts /tmp/p.jsonl --out $OUT/${m%%:*}-$prec-$b.jsonl --temperature 0 --tokens 48 --precision $prec 2> $OUT/${m%%:*}-$prec-$b.err; echo "${m%%:*} $prec $b rc $?: $(tail -1 $OUT/${m%%:*}-$prec-$b.err)"
    done
    cmp -s $OUT/${m%%:*}-$prec-old.jsonl $OUT/${m%%:*}-$prec-new.jsonl && echo "${m%%:*} $prec: outputs identical" || echo "${m%%:*} $prec: outputs DIFFER"
  done
done
