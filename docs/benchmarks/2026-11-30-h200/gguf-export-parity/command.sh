#!/usr/bin/env bash
# One H200, main at 0f57bdf (the kiln binary built from it), transformers 5.17.0, torch 2.11.0,
# gguf 0.17.1 (brought as a wheel). The fixture's GGUF travelled in four pieces and was joined
# and checked on the machine (sha256 b179c952...db53, as scripts/fetch-fixtures.sh verifies).
set -o pipefail
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# Random-initialised models (tokenizer: SmolLM2's, exported by kiln as a Hugging Face directory).
python3 bench/gguf_export_parity.py --kiln /tmp/kiln --tokenizer TOKDIR --outtypes "" \
  --work /tmp/ge | tee random-models.log
# SmolLM2-135M-Instruct at every --outtype.
python3 bench/gguf_export_parity.py --kiln /tmp/kiln --gguf /tmp/smol.gguf --random "" \
  --work /tmp/ge | tee smollm2.log
# Then, by hand (since folded into the script's random-model rows): transformers' rotary
# settings for the Llama-3.2-1B export, and kiln's greedy tokens from that export scored by the
# model it was saved from:
#   gguf config rope: {'rope_theta': 500000.0, 'rope_type': 'default'}
#   kiln (from its GGUF) vs the saved model: (192, 192, 1.33514404296875e-05)
