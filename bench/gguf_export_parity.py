"""kiln's GGUF exports read by transformers (`gguf_file=`), in one run.

Two kinds of source, each exported with `kiln export --to FILE.gguf`:

- SmolLM2-135M-Instruct's GGUF file (real weights; Q4_1 projections) at every --outtype kiln
  writes. transformers loads each export with its own GGUF reader (gguf-py's dequantisation),
  kiln decodes from the same file; both greedy in fp32, three prompts in the file's chat
  template. Also compared: the prompt ids of transformers' tokenizer rebuilt from the export's
  metadata (its chat template applied) against kiln's.
- Random-initialised models built by transformers from the configurations of Llama-3.2-1B
  (Llama 3 rotary scaling, written as `rope_freqs.weight`), Qwen3-0.6B (q/k norms) and
  Qwen2.5-0.5B (QKV biases), saved with save_pretrained, exported by kiln as f32 GGUF. Here
  transformers' model loaded from the GGUF is also held against the original it was saved
  from (the largest logit difference over the prompts): a wrong layout would show there even
  where kiln and transformers agreed on a wrong file.

    python3 bench/gguf_export_parity.py --kiln target/release/kiln --gguf SmolLM2.gguf

The GPU machine needs the `gguf` package (pure Python) for transformers' reader.
"""

import argparse
import os
import subprocess
import sys

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_parity as lp  # noqa: E402

OUTTYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k"]


def export(kiln, src, to, outtype):
    r = subprocess.run([kiln, "export", "--init-from", src, "--to", to, "--outtype", outtype],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return r.stderr.strip()[-300:] or f"exit {r.returncode}"
    return None


def from_gguf(path):
    d, f = os.path.split(path)
    return tf.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).cuda().eval()


def chat_ids(path, prompts):
    """Prompt ids from transformers' tokenizer rebuilt from the file, chat template applied."""
    d, f = os.path.split(path)
    tok = tf.AutoTokenizer.from_pretrained(d, gguf_file=f)
    out = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def max_logit_diff(a, b, lines):
    worst = 0.0
    for line in lines:
        x = torch.tensor([line["prompt_tokens"] + line["samples"][0]["tokens"]], device="cuda")
        with torch.no_grad():
            worst = max(worst, (a(x).logits.float() - b(x).logits.float()).abs().max().item())
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--gguf", default="", help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--tokenizer", default="",
                    help="a directory with tokenizer.json for the random models (default: "
                         "SmolLM2's, exported from --gguf)")
    ap.add_argument("--random", default="llama-3.2-1b,qwen3-0.6b,qwen2.5-0.5b",
                    help="the random-initialised configurations to export (empty: none)")
    ap.add_argument("--work", default="/tmp/kiln-gguf-export")
    ap.add_argument("--outtypes", default=",".join(OUTTYPES))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    rows = []

    for t in a.outtypes.split(",") if a.gguf and a.outtypes else []:
        out = os.path.join(a.work, f"smollm2-{t}.gguf")
        err = export(a.kiln, a.gguf, out, t)
        if err:
            rows.append((f"SmolLM2 {t}", "kiln export failed", err))
            continue
        size = os.path.getsize(out) / 2**20
        lines, note = lp.kiln_generate(a.kiln, ["--init-from", out, "--chat"], a.work, f"smol-{t}")
        if lines is None:
            rows.append((f"SmolLM2 {t}", "kiln refused its export", note))
            continue
        try:
            model = from_gguf(out)
        except Exception as e:  # transformers' refusal is the finding
            rows.append((f"SmolLM2 {t}", "transformers refused", repr(e)[:300]))
            continue
        same, total, worst = lp.compare(model, lines)
        try:
            ids = chat_ids(out, lp.PROMPTS)
            ids_same = sum(i == l["prompt_tokens"] for i, l in zip(ids, lines))
            tok = f"prompt ids equal {ids_same}/{len(lines)}"
        except Exception as e:
            tok = f"tokenizer: {repr(e)[:200]}"
        rows.append((f"SmolLM2 {t} ({size:.0f} MiB)", f"{same}/{total} greedy tokens identical",
                     f"max |logprob diff| {worst:.2e}; {tok}"))
        del model
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)

    # A tokenizer directory for the random models: SmolLM2's, exported as a Hugging Face one.
    tokdir = a.tokenizer or os.path.join(a.work, "smol-hf")
    if a.random and not os.path.isdir(tokdir):
        subprocess.run([a.kiln, "export", "--init-from", a.gguf, "--to", tokdir], check=True,
                       capture_output=True)
    tokfiles = os.path.join(a.work, "tokenizer")
    os.makedirs(tokfiles, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(tokdir, f)):
            subprocess.run(["cp", os.path.join(tokdir, f), tokfiles], check=True)

    for name, cfg in lp.configs():
        if name not in a.random.split(","):
            continue
        src = os.path.join(a.work, name)
        original = lp.save(cfg, src, tokfiles).cuda().eval()
        out = os.path.join(a.work, f"{name}.gguf")
        err = export(a.kiln, src, out, "f32")
        if err:
            rows.append((name, "kiln export failed", err))
            continue
        lines, note = lp.kiln_generate(a.kiln, ["--init-from", out], a.work, name)
        if lines is None:
            rows.append((name, "kiln refused its export", note))
            continue
        try:
            model = from_gguf(out)
        except Exception as e:
            rows.append((name, "transformers refused", repr(e)[:300]))
            continue
        same, total, worst = lp.compare(model, lines)
        drift = max_logit_diff(model, original, lines)
        # kiln reading its GGUF against the model it was exported from: where transformers'
        # reader drops something the file holds (Llama 3's scaling in `rope_freqs.weight`),
        # this is the comparison that still tests the file.
        k_same, k_total, k_worst = lp.compare(original, lines)
        rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None)
        rows.append((f"{name} f32", f"{same}/{total} greedy tokens identical",
                     f"max |logprob diff| {worst:.2e}; transformers from the GGUF against the "
                     f"model saved: max |logit diff| {drift:.2e} (its rotary settings {rope}); "
                     f"kiln from the GGUF against the model saved: {k_same}/{k_total} tokens, "
                     f"max |logprob diff| {k_worst:.2e}"))
        del model, original
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)

    print("\n| export | kiln and transformers (both reading kiln's GGUF) | detail |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    sys.exit(main())
