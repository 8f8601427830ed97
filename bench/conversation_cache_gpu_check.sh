#!/usr/bin/env bash
# On a GPU machine: a conversation (`kiln generate -i`) whose turns reuse the key/value cache of
# the turns before (NEW) against a build that prefills the whole conversation again each turn
# (OLD), on a random SmolLM2-135M-shaped model saved by transformers. Greedy, in fp32 and bf16,
# with and without CUDA graphs. The transcripts must agree token for token (fp32); the summary
# lines give the prompt tokens each build ran and its rates.
#   bash bench/conversation_cache_gpu_check.sh OLD_KILN NEW_KILN TOKENIZER_DIR WORK
set -u
OLD=$1; NEW=$2; TOK=$3; W=$4
mkdir -p "$W"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=$W/smollm2-135m
python3 - "$M" "$TOK" <<'EOF'
import os, shutil, sys, torch, transformers as tf
path, tok = sys.argv[1], sys.argv[2]
cfg = tf.LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
torch.manual_seed(0)
model = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
model.save_pretrained(path)
for f in os.listdir(tok):
    shutil.copy(os.path.join(tok, f), path)
print("saved", path, "transformers", tf.__version__, "torch", torch.__version__)
EOF
# Eight turns, a /reset after the fifth.
printf '%s\n' 'What is the capital of France?' 'And of Italy?' 'Name three rivers.' \
  'Which is the longest?' 'Say it again, shorter.' '/reset' 'And of Italy?' \
  'Name three mountains.' 'Which is the highest?' > "$W/turns.txt"
for dtype in fp32 bf16; do
  for graphs in "" "--no-cuda-graphs"; do
    for which in OLD NEW; do
      bin=$OLD; [ "$which" = NEW ] && bin=$NEW
      tag="$which-$dtype${graphs:+-nographs}"
      start=$EPOCHREALTIME
      "$bin" generate --init-from "$M" --device cuda --precision "$dtype" -i --system 'Be brief.' \
        --temperature 0 --tokens 64 $graphs < "$W/turns.txt" > "$W/$tag.txt" 2> "$W/$tag.err"
      rc=$?
      end=$EPOCHREALTIME
      printf '%-22s rc %s  %.2f s  %s\n' "$tag" "$rc" "$(awk "BEGIN { print $end - $start }")" "$(tail -1 "$W/$tag.err")"
    done
    a="$W/OLD-$dtype${graphs:+-nographs}.txt"; b="$W/NEW-$dtype${graphs:+-nographs}.txt"
    if cmp -s "$a" "$b"; then
      echo "  $dtype${graphs:+ no graphs}: transcripts identical ($(wc -l < "$a") lines)"
    else
      echo "  $dtype${graphs:+ no graphs}: transcripts DIFFER"; diff "$a" "$b" | head -8
    fi
  done
done
