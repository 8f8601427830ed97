#!/usr/bin/env bash
# The kept build (71a3b32) beside transformers generate in the same command: `kiln bench
# generate` (bf16, 64-token prompts, 128 new tokens, temperature 0.9, top-p 0.9), SmolLM2-135M at
# batches 1-64 and Llama-3.2-1B at batches 1, 8 and 64.
set -u
xz -dc gpubin/kiln-att.xz > /tmp/kiln; chmod +x /tmp/kiln
s=$(date +%s)
timeout 200 /tmp/kiln bench generate --shape smollm2-135m --batches 1 --new-tokens 8 --no-python --out /tmp/warm > /tmp/warm.log 2>&1; echo "warm rc $? t=$(( $(date +%s)-s ))"
for sh in smollm2-135m:1,8,16,32,64 llama-3.2-1b:1,8,64; do
  name=${sh%%:*}; b=${sh##*:}
  timeout 250 /tmp/kiln bench generate --shape $name --batches $b --new-tokens 128 --out /tmp/bg-$name > /tmp/$name.log 2>&1
  echo "$name rc $? t=$(( $(date +%s)-s ))"; grep -E "^(kiln|transformers) batch" /tmp/$name.log
  mkdir -p $OUT/$name; cp /tmp/bg-$name/report.md /tmp/bg-$name/results.json $OUT/$name/ 2>/dev/null
done
