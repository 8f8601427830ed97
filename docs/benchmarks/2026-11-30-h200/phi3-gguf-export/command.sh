#!/bin/bash
# One H200 (any machine with transformers and a GPU does); gpubin/ holds the kiln binary, the
# SmolLM2 tokenizer files (tok/) and llama.cpp's converter with its conversion/ and gguf-py/
# from the llama-cpp-python 0.3.36 sdist (llamacpp/).
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln && cd bench && \
  python3 phi3_gguf_export_check.py --kiln /tmp/kiln --tokenizer ../gpubin/tok \
    --llama-cpp ../gpubin/llamacpp --work /tmp/w 2>&1 | tee $OUT/phi3-gguf-export.txt
