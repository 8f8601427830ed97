#!/bin/bash
# CPU only. LLAMA_BIN: llama.cpp's build/bin (llama-simple, llama-tokenize); KILN: the binary.
set -e
$KILN export --init-from .cache/fixtures/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --to /tmp/smolhf
mkdir -p /tmp/smolphi3 && python3 make_phi3.py /tmp/smolhf /tmp/smolphi3
$KILN export --init-from /tmp/smolphi3 --to /tmp/smol-longrope.gguf --outtype f32
bash bench/llama_cpp_check.sh "$LLAMA_BIN" "$KILN" /tmp/smol-longrope.gguf /tmp/smol-lcpp > llama-cpp-check.txt
for p in "The capital of France is" "def fibonacci(n):" "Once upon a time, in a small village," \
         "Question: what is 17 times 23? Answer:"; do
  a=$($KILN generate --init-from /tmp/smol-longrope.gguf --prompt "$p" --tokens 32 --temperature 0 2>/dev/null)
  b=$($KILN generate --init-from /tmp/smolhf --prompt "$p" --tokens 32 --temperature 0 2>/dev/null)
  [ "$a" == "$b" ] && echo "same with and without LongRoPE: $p" || echo "different with LongRoPE: $p"
done > control.txt
