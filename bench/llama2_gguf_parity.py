"""Llama 2-style GGUF files, as llama.cpp's own converter writes them, read by kiln.

Most GGUF files people have (Llama 2, Mistral, and their fine-tunes) carry a SentencePiece BPE
vocabulary (`tokenizer.ggml.model = llama`), scores and byte-fallback tokens, and were written
by llama.cpp's `convert_hf_to_gguf.py`. This run makes such files without downloading a model:

1. SentencePiece trains a BPE vocabulary with Llama 2's settings on the bundled corpus;
2. transformers builds random-initialised Llama models over it (Llama 2's multi-head shape and
   a grouped-query one, untied embeddings), saved with save_pretrained beside the
   `tokenizer.model`;
3. llama.cpp's converter writes each as GGUF (f32, and q8_0 for the first);
4. kiln decodes 64 greedy tokens from the GGUF file (fp32, GPU) and transformers from the
   Hugging Face directory (the q8_0 file: from the same GGUF through `gguf_file=`), and kiln's
   tokenizer read from the GGUF is held against SentencePiece's own ids on a few thousand lines;
5. kiln also reads the Hugging Face directory itself, whose tokenizer is only SentencePiece's
   tokenizer.model: the same prompt ids and greedy replies as from the GGUF file.

    python3 bench/llama2_gguf_parity.py --kiln target/release/kiln \
        --convert llama.cpp/convert_hf_to_gguf.py [--work DIR]

Needs sentencepiece, transformers, torch and llama.cpp's `gguf` package (its gguf-py, on
PYTHONPATH) for the converter.
"""

import argparse
import gzip
import json
import os
import random
import subprocess
import sys

import sentencepiece as spm
import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_parity as lp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def train_vocab(work, corpus):
    prefix = os.path.join(work, "sp")
    text = os.path.join(work, "corpus.txt")
    open(text, "w", encoding="utf-8").write(corpus)
    # Llama 2's settings where they matter to encoding.
    spm.SentencePieceTrainer.train(
        input=text, model_prefix=prefix, vocab_size=4000, model_type="bpe", byte_fallback=True,
        character_coverage=0.9995, add_dummy_prefix=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", split_digits=True, max_sentence_length=100000,
        minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    return prefix + ".model"


def save(cfg, path, sp_model):
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    subprocess.run(["cp", sp_model, os.path.join(path, "tokenizer.model")], check=True)
    json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
               "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
               "model_max_length": 4096},
              open(os.path.join(path, "tokenizer_config.json"), "w"))
    return model


def texts(corpus):
    """Lines of the corpus and lines built to stress the tokenizer."""
    rng = random.Random(7)
    lines = [l for l in corpus.splitlines() if l.strip()]
    out = rng.sample(lines, 2000)
    out += [" ".join(rng.sample(lines, 3)) for _ in range(300)]
    out += ["  leading spaces", "trailing spaces   ", "tabs\there\tand\tthere", "numbers 1234567 and 3.14159",
            "unicode: café, naïve, Ελληνικά, русский, 日本語, 🙂🚀", "mixed\u00a0no-break space",
            "ALL CAPS SHOUTING", "x" * 200, "a  b   c    d", "'quoted' \"double\" `back`",
            "emoji 👩‍👩‍👧‍👦 family", "under_score and-hyphen", "https://example.com/path?q=1",
            "new\nline"]
    return [t for t in out if "\n" not in t]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--convert", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--work", default="/tmp/kiln-llama2-gguf")
    ap.add_argument("--keep", default="", help="copy the small model's GGUF here")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    corpus = gzip.open(os.path.join(HERE, "..", "data", "shakespeare.txt.gz"), "rt",
                       encoding="utf-8").read()[:1_500_000]
    sp_model = train_vocab(a.work, corpus)
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    rows = []

    common = dict(vocab_size=sp.get_piece_size(), hidden_size=512, intermediate_size=1376,
                  num_hidden_layers=4, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2)
    configs = [("llama2-style (8 heads, 8 key/value heads)",
                tf.LlamaConfig(num_attention_heads=8, num_key_value_heads=8, **common), ["f32", "q8_0"]),
               ("grouped-query (8 heads, 2 key/value heads)",
                tf.LlamaConfig(num_attention_heads=8, num_key_value_heads=2, **common), ["f32"]),
               # Small enough (14 MiB) to bring back for llama.cpp itself (--keep).
               ("small (width 256, 2 layers, 4 heads, 2 key/value heads)",
                tf.LlamaConfig(**dict(common, hidden_size=256, intermediate_size=688,
                                      num_hidden_layers=2), num_attention_heads=4,
                               num_key_value_heads=2), ["f32"])]
    first_gguf = None
    for i, (name, cfg, outtypes) in enumerate(configs):
        src = os.path.join(a.work, f"m{i}")
        original = save(cfg, src, sp_model).cuda().eval()
        for t in outtypes:
            out = os.path.join(a.work, f"m{i}-{t}.gguf")
            # The converter takes the gguf package beside it (llama.cpp's gguf-py, newer than the
            # release transformers reads with).
            env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(a.convert), "gguf-py"))
            r = subprocess.run([sys.executable, a.convert, src, "--outfile", out, "--outtype", t],
                               capture_output=True, text=True, env=env)
            if r.returncode != 0:
                rows.append((f"{name} {t}", "llama.cpp's converter failed", r.stderr.strip()[-300:]))
                continue
            first_gguf = first_gguf or out
            if a.keep and name.startswith("small"):
                subprocess.run(["cp", out, a.keep], check=True)
            lines, note = lp.kiln_generate(a.kiln, ["--init-from", out], a.work, f"m{i}-{t}")
            if lines is None:
                rows.append((f"{name} {t}", "kiln refused the file", note))
                continue
            ids_ok = sum(l["prompt_tokens"] == [1] + sp.encode(p) for l, p in zip(lines, lp.PROMPTS))
            if ids_ok < len(lines):
                print("kiln's prompt ids", lines[0]["prompt_tokens"], "SentencePiece's",
                      [1] + sp.encode(lp.PROMPTS[0]), flush=True)
            if t == "f32":
                ref = original
            else:
                d, f = os.path.split(out)
                ref = tf.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).cuda().eval()
            same, total, worst = lp.compare(ref, lines)
            rows.append((f"{name} {t}", f"{same}/{total} greedy tokens identical",
                         f"max |logprob diff| {worst:.2e}; prompt ids = [BOS] + SentencePiece's: "
                         f"{ids_ok}/{len(lines)}; against "
                         f"{'the saved model' if t == 'f32' else 'transformers reading the same GGUF'}"))
            print(rows[-1], flush=True)
            if ref is not original:
                del ref
            if t == "f32":
                # The directory itself, whose tokenizer is only SentencePiece's tokenizer.model.
                dlines, dnote = lp.kiln_generate(a.kiln, ["--init-from", src], a.work, f"m{i}-dir")
                if dlines is None:
                    rows.append((f"{name}, the Hugging Face directory", "kiln refused it", dnote))
                else:
                    same_ids = sum(x["prompt_tokens"] == y["prompt_tokens"] for x, y in zip(dlines, lines))
                    same_out = sum(x["samples"][0]["tokens"] == y["samples"][0]["tokens"]
                                   for x, y in zip(dlines, lines))
                    rows.append((f"{name}, the Hugging Face directory (tokenizer.model only)",
                                 f"prompt ids as from the GGUF {same_ids}/{len(lines)}",
                                 f"greedy replies as from the GGUF {same_out}/{len(lines)}"))
                print(rows[-1], flush=True)
        del original
        torch.cuda.empty_cache()

    if first_gguf:
        sample = texts(corpus)
        inp = os.path.join(a.work, "texts.txt")
        open(inp, "w", encoding="utf-8").write("\n".join(sample) + "\n")
        r = subprocess.run([a.kiln, "tokenize", "--tokenizer", first_gguf, "--input", inp],
                           capture_output=True, text=True)
        if r.returncode != 0:
            rows.append(("tokenizer", "kiln tokenize failed", r.stderr.strip()[-300:]))
        else:
            got = [json.loads(l) for l in r.stdout.splitlines()]
            want = [sp.encode(t) for t in sample]
            equal = sum(g == w for g, w in zip(got, want))
            bad = next((t for t, g, w in zip(sample, got, want) if g != w), None)
            rows.append(("tokenizer from the converter's GGUF", f"{equal}/{len(sample)} lines equal "
                         "to SentencePiece's ids", f"first differing line: {bad!r}" if bad else
                         f"{sum(len(w) for w in want)} tokens"))
            print(rows[-1], flush=True)

    print("\n| file (llama.cpp's converter) | kiln | detail |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    sys.exit(main())
