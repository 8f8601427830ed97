#!/usr/bin/env python3
"""Exact token-id parity of `kiln tokenize` against Hugging Face transformers.

    python bench/tokenizer_parity.py KILN_BIN SMOLLM2_GGUF MINILM_DIR [--corpus FILE]

Needs `pip install "transformers==4.*" tokenizers gguf` (no torch: transformers 4 reads a
GGUF's vocabulary without it once its blanket "torch is installed" check is skipped, which
this script does; transformers 5's GGUF reader imports torch itself).

The lines compared: every non-empty line among the first --corpus-lines lines of --corpus,
the hand-written lines below (unicode, emoji, digit runs, code, whitespace runs, chat
special tokens), and --random-lines seeded random mixtures of all of those.

Three comparisons:

  smollm2 (transformers GGUF)   kiln's ids for the GGUF file vs
      AutoTokenizer.from_pretrained(dir, gguf_file=...).encode(line, add_special_tokens=False).
      transformers' GGUF converter gives every byte-level BPE vocabulary of a llama GGUF the
      plain GPT-2 pre-tokenizer and ignores tokenizer.ggml.pre, so for SmolLM2 (pre =
      "smollm") it does not split digit runs into single digits as the model's own
      tokenizer.json does; lines with digits in them differ for that reason alone.
  smollm2 (model pre-tokenizer) the same transformers tokenizer with the pre-tokenizer of
      SmolLM2's published tokenizer.json, Sequence[Digits(individual_digits=True),
      ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]; this is the
      tokenizer the model was trained with, and kiln must match it exactly.
  minilm --special              `kiln tokenize --special` on the directory vs
      AutoTokenizer.from_pretrained(dir).encode(line) ([CLS] ... [SEP]).

Exit status 0 when the last two match on every line, 1 otherwise.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

HAND_WRITTEN = [
    "Hello world",
    "hello world",
    " Hello world",
    "Hello  world",
    "Hello\tworld",
    "   leading spaces",
    "trailing spaces   ",
    "    ",
    "\t",
    " \t \t ",
    "a\u00a0b\u00a0\u00a0c",  # no-break spaces
    "ideographic\u3000space and thin\u2009space",
    "vertical\x0btab and form\x0cfeed",
    "line\u2028separator and next\x85line",
    "mid\rcarriage return",
    "I'm sure they'll say it's fine, don't you think? We've seen it. I'D SAY YOU'RE RIGHT",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade \u00c5ngstr\u00f6m",
    "e\u0301 combining acute, n\u0303 tilde",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u8fd9\u662f\u4e00\u4e2a\u6d4b\u8bd5\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca \u30fc",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4",
    "\u0420\u043e\u0441\u0441\u0438\u044f \u0438 \u0423\u043a\u0440\u0430\u0457\u043d\u0430",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "Emoji: \U0001f600\U0001f44d\U0001f3fd\U0001f1fa\U0001f1f8 and \u2764\ufe0f",
    "family \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 zwj",
    "\U0001f980\U0001f980\U0001f980 crabs",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom",
    "Numbers 12345 and 3.14159 and 1,000,000",
    "0",
    "007",
    "1234567890123456789012345678901234567890",
    "v1.2.3-rc4 2024-01-31T12:34:56Z",
    "\u0661\u0662\u0663 arabic-indic, \u0967\u0968\u0969 devanagari, \u00b2\u00b3\u00bd superscripts",
    "\uff11\uff12\uff13 fullwidth digits, \u2460\u2461 circled",
    "Punctuation!!! ??? ... --- (parens) [brackets] {braces} <angles>",
    "def foo(x):    return x ** 2  # square",
    "fn main() { println!(\"{}\", 1 + 2); }",
    "    if (a && b || !c) { x += y >> 2; }",
    "for i in range(10):\tprint(i, end='')",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "SELECT * FROM users WHERE id = 42;",
    "https://example.com/path?query=1&x=y#frag",
    "user@example.com",
    "$HOME/.config ~/bin C:\\Windows\\System32",
    "<|im_start|>user\nhi<|im_end|>".replace("\n", " "),
    "<|im_start|>user",
    "hi<|im_end|>",
    "<|im_start|>assistant The capital of France is Paris.<|im_end|>",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|><|im_start|>",
    " <|im_start|> spaced <|im_end|> ",
    "<|im_start",
    "<|im_sta rt|>",
    "<repo_name>kiln<file_sep>src/main.rs<filename>",
    "<|IM_START|> uppercase is not special",
    "[CLS] [SEP] [MASK] [PAD] [UNK] bert specials in text",
    "don't DON'T Don't",
    "'s 't 're 've 'm 'll 'd",
    "a" * 300,
    "word " * 200,
    "\u00e9" * 100,
    "!" * 50,
    " " * 40 + "x",
    "x" + "\t" * 20 + "y",
    "mixed  \t  \u00a0 whitespace\u3000\u3000run",
    "ALL CAPS SHOUTING AND lower and MiXeD",
    "hyphen-ated well-known state-of-the-art",
    "\u201csmart quotes\u201d \u2018single\u2019 \u2014 em dash \u2013 en dash \u2026",
    "\u00bfQu\u00e9? \u00a1S\u00ed! \u00ab\u00a0guillemets\u00a0\u00bb",
    "\u03b1\u03b2\u03b3 \u2211 \u222b \u221e \u2248 \u2260 \u2264 \u2265",
    "\U0001d400\U0001d401 math bold, \U00010348 gothic",
    "\ue000 private use \U000f0000",
    "\x00 nul and \x01\x02\x1f controls \x7f del",
]

WORDS = (
    "the of and to in is you that it he was for on are as with his they I at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could people "
    "thou thee thy hath doth wherefore ere o'er 'tis"
).split()
PIECES = [
    "0", "7", "42", "2024", "3.14", "1,000", "99999999", "0x1F", "1e-9",
    " ", "  ", "   ", "\t", "\t\t", " \t", "\u00a0", "\u3000", "\r",
    ".", ",", "!", "?", "...", "--", "'", "\"", "'s", "'ll", "n't", ":", ";", "(", ")", "[", "]",
    "{", "}", "<", ">", "=", "==", "->", "=>", "::", "#", "@", "$", "%", "^", "&", "*", "/", "\\",
    "|", "~", "`", "_", "__init__", "self.x", "fn", "let", "def", "return", "//", "/*", "*/",
    "\u00e9", "\u00fc", "\u00df", "\u00f1", "e\u0301", "\u4e2d\u6587", "\u65e5\u672c",
    "\ud55c", "\u0416", "\u05e9\u05dc\u05d5\u05dd", "\u0e44\u0e17\u0e22", "\u0928\u092e",
    "\U0001f600", "\U0001f980", "\u2764\ufe0f", "\U0001f44d\U0001f3fd", "\U0001f1eb\U0001f1f7",
    "\u200b", "\u200d", "\ufeff", "\u2028", "\x85", "\x0b", "\x0c",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user", "<|im_start|>assistant",
    "<|im_", "|>", "<", "[CLS]", "[SEP]",
]


def random_line(rng):
    parts = []
    for _ in range(rng.randint(1, 24)):
        r = rng.random()
        if r < 0.45:
            w = rng.choice(WORDS)
            w = w.capitalize() if rng.random() < 0.2 else w.upper() if rng.random() < 0.05 else w
            parts.append((" " if rng.random() < 0.7 else "") + w)
        else:
            parts.append(rng.choice(PIECES))
    return "".join(parts)


def kiln_text(line):
    """The text kiln sees for an input line: one trailing \\r (of a \\r\\n ending) is removed."""
    return line[:-1] if line.endswith("\r") else line


def kiln_ids(kiln, tokenizer, lines, special):
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write("".join(line + "\n" for line in lines).encode("utf-8"))
        path = f.name
    try:
        cmd = [kiln, "tokenize", "--tokenizer", tokenizer, "--input", path]
        if special:
            cmd.append("--special")
        out = subprocess.run(cmd, capture_output=True, check=False)
        if out.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr.decode()}")
        rows = out.stdout.decode().splitlines()
        if len(rows) != len(lines):
            sys.exit(f"kiln wrote {len(rows)} lines for {len(lines)} input lines")
        return [json.loads(r) for r in rows]
    finally:
        os.unlink(path)


def load_gguf_tokenizer(gguf):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    # Reading a GGUF's metadata (return_tensors=False) does not use torch; only this blanket
    # check asks for it.
    gguf_utils.is_torch_available = lambda: True
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf)), gguf_file=os.path.basename(gguf)
    )


def with_model_pre_tokenizer(tok):
    """A copy of `tok` with SmolLM2's own tokenizer.json pre-tokenizer."""
    import copy

    from tokenizers import pre_tokenizers

    tok = copy.deepcopy(tok)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return tok


def compare(name, lines, ours, theirs, tok, show):
    same = sum(a == b for a, b in zip(ours, theirs))
    mismatches = [(l, a, b) for l, a, b in zip(lines, ours, theirs) if a != b]
    no_digit = sum(not any(c.isdigit() for c in l) for l, _, _ in mismatches)
    examples = []
    for line, a, b in mismatches[:show]:
        # From a little before the first id that differs.
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lo = max(0, first - 3)
        ids = lambda v: f"{'... ' if lo else ''}{v[lo:lo + 12]}{' ...' if len(v) > lo + 12 else ''}"
        examples.append(
            f"  {name}: {line[:70]!r} (ids differ from position {first})\n"
            f"    kiln:         {ids(a)}\n"
            f"                  {tok.convert_ids_to_tokens(a[lo:lo + 12])}\n"
            f"    transformers: {ids(b)}\n"
            f"                  {tok.convert_ids_to_tokens(b[lo:lo + 12])}"
        )
    return (name, len(lines), same, no_digit), examples


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kiln", help="the kiln binary (target/release/kiln)")
    p.add_argument("gguf", help="SmolLM2-135M-Instruct GGUF file")
    p.add_argument("minilm", help="all-MiniLM-L6-v2 directory (tokenizer.json)")
    p.add_argument("--corpus", required=True, help="a UTF-8 text, e.g. the bundled corpus data/shakespeare.txt")
    p.add_argument("--corpus-lines", type=int, default=3000)
    p.add_argument("--random-lines", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=5, help="mismatches shown per comparison")
    a = p.parse_args()

    import transformers

    transformers.logging.set_verbosity_error()

    with open(a.corpus, encoding="utf-8", newline="") as f:
        corpus = f.read().split("\n")[: a.corpus_lines]
    rng = random.Random(a.seed)
    lines = [l for l in corpus if l] + HAND_WRITTEN + [random_line(rng) for _ in range(a.random_lines)]
    assert not any("\n" in l for l in lines)
    texts = [kiln_text(l) for l in lines]
    print(
        f"{len(lines)} lines: {sum(1 for l in corpus if l)} corpus, {len(HAND_WRITTEN)} hand-written, "
        f"{a.random_lines} random (seed {a.seed}); transformers {transformers.__version__}"
    )

    smol = load_gguf_tokenizer(a.gguf)
    smol_model = with_model_pre_tokenizer(smol)
    from transformers import AutoTokenizer

    minilm = AutoTokenizer.from_pretrained(a.minilm)

    kiln_smol = kiln_ids(a.kiln, a.gguf, lines, special=False)
    kiln_minilm = kiln_ids(a.kiln, a.minilm, lines, special=True)
    rows, examples = [], []
    for name, ours, tok, special in [
        ("smollm2 (transformers GGUF)", kiln_smol, smol, False),
        ("smollm2 (model pre-tokenizer)", kiln_smol, smol_model, False),
        ("minilm --special", kiln_minilm, minilm, True),
    ]:
        theirs = [tok.encode(t, add_special_tokens=special) for t in texts]
        row, ex = compare(name, texts, ours, theirs, tok, a.show)
        rows.append(row)
        examples += ex

    print(f"\n{'comparison':<32}{'lines':>7}{'identical':>11}{'differ':>8}{'  of which without digits':>27}")
    for name, n, same, no_digit in rows:
        print(f"{name:<32}{n:>7}{same:>11}{n - same:>8}{no_digit:>27}")
    if examples:
        print("\nfirst mismatches:")
        print("\n".join(examples))
    ok = all(n == same for _, n, same, _ in rows[1:])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
