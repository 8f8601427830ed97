#!/usr/bin/env bash
# On a GPU machine: the imported decoders against transformers (bench/llama_parity.py), then a
# conversation (`kiln generate -i`) on the random SmolLM2-shaped model that run saves, with and
# without CUDA graphs; its first reply must equal a lone `--chat --prompt` reply, and the two
# conversations must agree token for token.
#   bash bench/conversation_gpu_check.sh KILN TOKENIZER_DIR WORK
set -u
K=$1; TOK=$2; W=$3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
python3 bench/llama_parity.py --kiln "$K" --tokenizer "$TOK" --work "$W"
echo "parity rc $?"
M=$W/smollm2-135m
printf 'What is the capital of France?\nAnd of Italy?\nName three rivers.\n/reset\nAnd of Italy?\n' > "$W/turns.txt"
"$K" generate --init-from "$M" --device cuda -i --system 'Be brief.' --temperature 0 --tokens 24 < "$W/turns.txt" > "$W/graphs.txt" 2> "$W/graphs.err"; echo "interactive rc $?"
"$K" generate --init-from "$M" --device cuda -i --system 'Be brief.' --temperature 0 --tokens 24 --no-cuda-graphs < "$W/turns.txt" > "$W/direct.txt" 2> "$W/direct.err"; echo "interactive, no graphs rc $?"
"$K" generate --init-from "$M" --device cuda --chat --system 'Be brief.' --prompt 'What is the capital of France?' --temperature 0 --tokens 24 > "$W/lone.txt" 2> "$W/lone.err"; echo "lone rc $?"
tail -1 "$W/graphs.err"; tail -1 "$W/direct.err"
cmp "$W/graphs.txt" "$W/direct.txt" && echo "conversations identical with and without CUDA graphs ($(wc -l < "$W/graphs.txt") lines)"
if [ "$(head -c "$(wc -c < "$W/lone.txt")" "$W/graphs.txt")" = "$(cat "$W/lone.txt")" ]; then
  echo "first reply equals the lone --chat reply"
else
  echo "first reply DIFFERS from the lone --chat reply"; head -2 "$W/graphs.txt"; cat "$W/lone.txt"
fi
