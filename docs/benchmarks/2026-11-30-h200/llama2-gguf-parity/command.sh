#!/usr/bin/env bash
# One H200, transformers 5.17.0, torch 2.11.0, sentencepiece 0.2.2; llama.cpp's converter
# (convert_hf_to_gguf.py, its conversion/ and gguf-py, from the llama.cpp that the PyPI sdist
# llama-cpp-python 0.3.36 vendors) brought along; gguf 0.17.1 for transformers' reader.
set -o pipefail
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# before-bos-fix-full.log: the kiln binary of 0f57bdf.
# after-bos-fix.log: the kiln binary of 69cb585 (BOS for plain prompts), with --keep.
python3 bench/llama2_gguf_parity.py --kiln /tmp/kiln --convert LLAMACPP/convert_hf_to_gguf.py \
  --work /tmp/l2 --keep $OUT/llama2-small.gguf
# Then on a 2-core CPU machine, the small model's file against llama.cpp itself (a CPU build of
# the same llama.cpp), greedy, 32 tokens:
#   for p in "ROMEO: Wherefore art thou" "The king is dead"; do
#     llama-simple -m llama2-small.gguf -n 32 "$p"
#     kiln generate --init-from llama2-small.gguf --prompt "$p" --tokens 32 --temperature 0
#   done
