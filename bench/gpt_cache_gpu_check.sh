#!/usr/bin/env bash
# On a GPU machine: GPT decoding through its key/value cache.
#   bash bench/gpt_cache_gpu_check.sh KILN TOKENIZER_DIR WORK OUT
# 1. the cache kernels at GPT's shapes (no rotation, a key/value head per head) against the
#    CPU; 2. a random GPT-2 small built by transformers, decoded greedily in fp32 by both
#    (bench/llama_parity.py); 3. `kiln bench generate` on it beside transformers' generate;
#    4. the default GPT trained briefly, its greedy fp32 text on the GPU and on the CPU.
set -u
K=$1; TOK=$2; W=$3; OUT=$4
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$K" selftest --only kernels --match kv_append,cache_attention,copy_cache_slot 2>&1 | grep -E "H12/12|H4/4|K12|K4 |checks|failed|FAIL" | tail -40
python3 bench/llama_parity.py --kiln "$K" --tokenizer "$TOK" --work "$W" --only gpt2-small 2>&1 | grep -v -i "warn\|shards\|deprecated"
"$K" bench generate --init-from "$W/gpt2-small" --batches 1,8,64 --reference-batches 1,64 --out "$OUT/bench-generate-gpt2" 2>&1 | tail -25
"$K" train --out "$W/tiny" -q train.steps=300 > "$W/train.log" 2>&1; echo "train rc $?"; tail -2 "$W/train.log"
"$K" generate --run "$W/tiny" --device cuda --precision fp32 --temperature 0 --tokens 120 > "$W/gpu.txt" 2> "$W/gpu.err"; echo "gpu rc $?"; tail -1 "$W/gpu.err"
"$K" generate --run "$W/tiny" --device cpu --temperature 0 --tokens 120 > "$W/cpu.txt" 2> "$W/cpu.err"; echo "cpu rc $?"; tail -1 "$W/cpu.err"
cmp "$W/gpu.txt" "$W/cpu.txt" && echo "default GPT: greedy text identical on the GPU (fp32) and the CPU ($(wc -c < "$W/gpu.txt") bytes)"
head -c 300 "$W/gpu.txt"; echo
"$K" generate --run "$W/tiny" --device cuda --temperature 0.8 --tokens 120 --num-samples 4 --prompts <(printf '{"prompt": "ROMEO:"}\n{"prompt": "JULIET:"}\n') > "$W/batch.jsonl" 2> "$W/batch.err"; echo "batch rc $?"; tail -1 "$W/batch.err"
