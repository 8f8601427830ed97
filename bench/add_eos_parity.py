"""kiln's add_bos_token / add_eos_token handling against transformers' tokenizers.

    python3 bench/add_eos_parity.py --kiln target/release/kiln --model tests/data/spm_bpe.model

Builds Hugging Face directories around one SentencePiece model with every combination of the
two flags, in three layouts: the model alone (class LlamaTokenizer), and beside a tokenizer.json
whose post-processor adds BOS only (classes LlamaTokenizer and PreTrainedTokenizerFast). Encodes
a few texts with add_special_tokens=True in transformers and with `kiln tokenize --special`,
and prints one row per directory: whether the ids agree, and where transformers puts BOS and
EOS. No GPU is needed.
"""
import argparse, json, os, shutil, subprocess, tempfile

from transformers import AutoTokenizer

TEXTS = ["Hello world", "To be, or not to be: that is the question.", "a", ""]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--model", required=True, help="a SentencePiece tokenizer.model")
    a = ap.parse_args()
    failures = 0
    with tempfile.TemporaryDirectory() as work:
        base = os.path.join(work, "base")
        os.makedirs(base)
        shutil.copy(a.model, os.path.join(base, "tokenizer.model"))
        with open(os.path.join(base, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                       "add_eos_token": False}, f)
        bos_only = os.path.join(work, "tokenizer.json")
        AutoTokenizer.from_pretrained(base).backend_tokenizer.save(bos_only)
        count = 0
        for layout, cls in [("model", "LlamaTokenizer"), ("json", "LlamaTokenizer"),
                            ("json", "PreTrainedTokenizerFast")]:
            for bos in [True, False]:
                for eos in [True, False]:
                    d = os.path.join(work, f"{layout}-{cls}-{bos}-{eos}")
                    os.makedirs(d)
                    shutil.copy(a.model, os.path.join(d, "tokenizer.model"))
                    if layout == "json":
                        shutil.copy(bos_only, d)
                    cfg = {"tokenizer_class": cls, "add_bos_token": bos, "add_eos_token": eos,
                           "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
                    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
                        json.dump(cfg, f)
                    hf = AutoTokenizer.from_pretrained(d)
                    want = [hf(t, add_special_tokens=True)["input_ids"] for t in TEXTS]
                    out = subprocess.run([a.kiln, "tokenize", "--tokenizer", d, "--special"],
                                         input="\n".join(TEXTS) + "\n", capture_output=True,
                                         text=True, check=True).stdout
                    got = [json.loads(l) for l in out.splitlines()]
                    same = got == want
                    failures += not same
                    count += 1
                    print(f"{layout:5} {cls:24} add_bos={bos!s:5} add_eos={eos!s:5} "
                          f"transformers: {want[0]} kiln: {got[0]} {'same' if same else 'DIFFERENT'}")
    print(f"{failures} of {count} directories differ")


if __name__ == "__main__":
    main()
