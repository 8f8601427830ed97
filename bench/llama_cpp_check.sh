#!/usr/bin/env bash
# llama.cpp runs kiln's GGUF exports (CPU, no GPU needed).
#
#   bench/llama_cpp_check.sh LLAMA_BIN_DIR KILN SOURCE.gguf [WORK]
#
# LLAMA_BIN_DIR holds llama.cpp's `llama-simple` and `llama-tokenize` (a CPU build:
# `cmake -B build && cmake --build build --target llama-simple llama-tokenize`). kiln exports
# SOURCE (for example SmolLM2-135M-Instruct.Q4_1.gguf) at each --outtype; then, for SOURCE itself
# (the control) and each file:
#   - llama-simple and `kiln generate` continue four prompts greedily (32 tokens) and the two
#     texts are compared (llama.cpp's CPU products quantise activations for the quantised
#     types, kiln dequantises the weights to f32, so those may part after some tokens);
#   - llama-tokenize and `kiln tokenize` encode 300 lines of the bundled corpus and a few
#     built to stress a tokenizer (first file only).
set -uo pipefail
BIN=$1 K=$2 SRC=$3 W=${4:-/tmp/kiln-llama-cpp}
mkdir -p "$W"
PROMPTS=("The capital of France is" "def fibonacci(n):" "Once upon a time, in a small village,"
         "Question: what is 17 times 23? Answer:")
echo "| export | prompt | llama.cpp and kiln |"
echo "|---|---|---|"
first=""
for t in source f32 q8_0 q4_0 q4_k; do
  f="$W/export-$t.gguf"
  if [ "$t" == source ]; then
    f=$SRC  # the file kiln exported from, as a control: how far the two engines agree on it
  else
    "$K" export --init-from "$SRC" --to "$f" --outtype "$t" > /dev/null 2>&1 || { echo "| $t | | kiln export failed |"; continue; }
    [ -n "$first" ] || first=$f
  fi
  for p in "${PROMPTS[@]}"; do
    a=$("$BIN/llama-simple" -m "$f" -n 32 "$p" 2>/dev/null)
    b=$("$K" generate --init-from "$f" --prompt "$p" --tokens 32 --temperature 0 2>/dev/null)
    if [ "$a" == "$b" ]; then
      echo "| $t | $p | identical ($(printf %s "$a" | wc -c) bytes) |"
    else
      n=$(python3 -c 'import sys
a, b = sys.argv[1], sys.argv[2]
print(next(i for i in range(min(len(a), len(b)) + 1) if i == min(len(a), len(b)) or a[i] != b[i]))' "$a" "$b")
      echo "| $t | $p | the same for $n characters, then llama.cpp: $(printf %q "${a:$n:40}") kiln: $(printf %q "${b:$n:40}") |"
    fi
  done
done
# Tokenizer: line by line.
python3 - "$W/lines.txt" <<'PY'
import gzip, random, sys, os
here = os.getcwd()
corpus = gzip.open(os.path.join(here, "data", "shakespeare.txt.gz"), "rt", encoding="utf-8").read()
lines = [l for l in corpus.splitlines() if l.strip()]
rng = random.Random(11)
out = rng.sample(lines, 280)
out += ["  leading spaces", "trailing spaces   ", "tabs\there\tand\tthere",
        "numbers 1234567 and 3.14159", "unicode: café, naïve, Ελληνικά, русский, 日本語, 🙂🚀",
        "mixed\u00a0no-break space", "ALL CAPS SHOUTING", "a  b   c    d",
        "'quoted' \"double\" `back`", "emoji 👩‍👩‍👧‍👦 family", "under_score and-hyphen",
        "https://example.com/path?q=1", "<|im_start|>user", "don't won't I'll we've", "x" * 120,
        "  ", "αβγ δεζ", "2024-01-01T12:00:00Z", "e=mc^2; f(x)=x**2", "end."]
open(sys.argv[1], "w", encoding="utf-8").write("\n".join(out) + "\n")
PY
"$K" tokenize --tokenizer "$first" --input "$W/lines.txt" > "$W/kiln-ids.txt" 2>/dev/null
same=0 total=0 firstbad=""
while IFS= read -r line && IFS= read -r ids <&3; do
  total=$((total + 1))
  theirs=$("$BIN/llama-tokenize" -m "$first" -p "$line" --ids --log-disable 2>/dev/null | tail -1)
  if [ "${theirs// /}" == "${ids// /}" ]; then same=$((same + 1)); else [ -n "$firstbad" ] || firstbad="$line: llama.cpp $theirs kiln $ids"; fi
done < "$W/lines.txt" 3< "$W/kiln-ids.txt"
echo
echo "tokenizer ($(basename "$first")): $same of $total lines give llama.cpp's ids${firstbad:+; first that differs: $firstbad}"
