#!/usr/bin/env python3
"""Writes tests/data/spm_bpe.json: a SentencePiece BPE vocabulary and the ids SentencePiece
itself gives 314 texts, the reference for kiln's reading of GGUF SentencePiece vocabularies; and
tests/data/spm_bpe.model, the same vocabulary as SentencePiece saves it (tokenizer.model).

Needs the `sentencepiece` package (0.2.3 made the committed file). Run from the repository
root: python3 scripts/make-spm-fixture.py /path/to/shakespeare.txt
"""
import json
import random
import sys
import tempfile

import sentencepiece as spm

corpus = open(sys.argv[1], encoding="utf-8").read()[:1_500_000]
with tempfile.TemporaryDirectory() as tmp:
    text_path = f"{tmp}/corpus.txt"
    open(text_path, "w", encoding="utf-8").write(corpus)
    # Llama 2's settings where they matter to encoding: BPE, byte fallback, a space prefix,
    # whitespace kept as it is, digits split.
    spm.SentencePieceTrainer.train(
        input=text_path, model_prefix=f"{tmp}/sp", vocab_size=1200, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, add_dummy_prefix=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", split_digits=True,
        max_sentence_length=100000, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    sp = spm.SentencePieceProcessor(model_file=f"{tmp}/sp.model")
    # The model file itself, for kiln's reader of Hugging Face directories that carry only a
    # tokenizer.model.
    open("tests/data/spm_bpe.model", "wb").write(open(f"{tmp}/sp.model", "rb").read())

pieces = []
for i in range(sp.get_piece_size()):
    # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 5 unused, 6 byte.
    kind = 1
    if sp.is_unknown(i):
        kind = 2
    elif sp.is_control(i):
        kind = 3
    elif sp.is_byte(i):
        kind = 6
    elif sp.is_unused(i):
        kind = 5
    pieces.append([sp.id_to_piece(i), sp.get_score(i), kind])

random.seed(3)
texts = random.sample([l for l in corpus.split("\n") if l.strip()], 300)
texts += ["Hello world", "  two leading spaces", "trailing  ", "a  b   c", "numbers 12345 and 3.14",
          "Ünïcödé ünïcode — dashes – and “quotes”", "emoji 🙂 and 漢字", "tab\there", "", " ",
          "ROMEO: Wherefore art thou?", "x" * 40, "don't won't can't", "MixedCASE words AND more"]
json.dump({"source": f"sentencepiece {spm.__version__} BPE, vocab 1200, byte_fallback, trained on "
                     "the first 1.5 MB of the bundled corpus",
           "pieces": pieces, "cases": [[t, sp.encode(t)] for t in texts]},
          open("tests/data/spm_bpe.json", "w", encoding="utf-8"), ensure_ascii=False)
