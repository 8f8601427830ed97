#!/bin/sh
# From the repository root on the GPU machine: gpubin/kiln-head.xz is the release build of the
# commit under test (stripped, xz), gpubin/tok the SmolLM2-135M-Instruct tokenizer files
# (tokenizer.json, tokenizer_config.json) as `kiln export --init-from` writes them from the
# fixture GGUF, gpubin/llamacpp llama.cpp's convert_hf_to_gguf.py with its conversion/ and
# gguf-py/ (from the llama_cpp_python 0.3.36 sdist on PyPI).
set -e
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln
mkdir -p $OUT
(time python3 bench/phi3_parity.py --kiln /tmp/kiln --tokenizer gpubin/tok --work /tmp/phi3 --llama-cpp gpubin/llamacpp) > $OUT/phi3.log 2>&1
