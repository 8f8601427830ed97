"""Parity of kiln's imported decoders with transformers, in one run.

For each architecture, transformers builds a random-initialised model from a published
configuration and saves it with save_pretrained (with a tokenizer beside it); kiln imports the
directory (`kiln generate --init-from`, fp32 on the GPU) and decodes 64 greedy tokens for three
prompts; transformers decodes the same prompt ids greedily in fp32. Reported: greedy tokens that agree
before the first divergence, and the largest difference of the chosen tokens' log-probabilities. Then a kiln run trained from
an imported model is exported (`kiln export`) and loaded by transformers, and the two engines'
log-probabilities along kiln's greedy tokens are compared.

    python3 bench/llama_parity.py --kiln target/release/kiln --tokenizer DIR --work /tmp/parity

With --gguf FILE (for example SmolLM2-135M-Instruct.Q4_1.gguf) the real model is compared too:
kiln decodes from the GGUF file itself, transformers from the same weights written back as a
Hugging Face directory by `kiln export --init-from FILE` (dequantised to f32).

With --long-prompts the full-attention models get prompts of about 100 tokens: a GPU then
prefills them through the training attention (prompts of 16 tokens or more), not row by row.

With --windowed the sliding-window configurations run instead (a Mistral attending to its 64
latest positions, a Qwen2 whose last two layers attend to 48): prompts of about 100 tokens and
128 new ones, so every query past position 64 loses keys to the window; transformers applies
its sliding-window masks (masking_utils: key j is seen by query i when i - W < j <= i). As a control, the same weights without the
window score kiln's tokens too: that difference must be large, or the check proves nothing.
--json FILE writes the rows for a script to judge.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch
import transformers as tf

PROMPTS = [
    "The history of the city begins",
    "def fibonacci(n):",
    "Question: what is 17 times 23? Answer:",
]


def configs():
    llama1b = tf.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True)
    smol = tf.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
    qwen3 = tf.Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True)
    # Qwen2.5-0.5B: query/key/value biases, 2 key/value heads.
    qwen25 = tf.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
    gpt2 = tf.GPT2Config()
    return [("llama-3.2-1b", llama1b), ("smollm2-135m", smol), ("gpt2-small", gpt2),
            ("qwen3-0.6b", qwen3), ("qwen2.5-0.5b", qwen25)]


def windowed_configs():
    mistral = tf.MistralConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=64, tie_word_embeddings=False)
    qwen2 = tf.Qwen2Config(
        vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rope_theta=1000000.0, use_sliding_window=True, sliding_window=48, max_window_layers=2,
        tie_word_embeddings=True)
    return [("mistral-swa64", mistral), ("qwen2-swa48-from-layer2", qwen2)]


# About 100 tokens each, so that prompt and reply together run well past the window.
LONG_PROMPTS = [" ".join([p] * 12) for p in PROMPTS]


def without_window(cfg):
    """The same configuration attending fully."""
    c = cfg.__class__.from_dict(cfg.to_dict())
    if isinstance(c, tf.MistralConfig):
        c.sliding_window = None
    else:
        c.use_sliding_window = False
        c.sliding_window = None
        c.layer_types = ["full_attention"] * c.num_hidden_layers
    return c


def run_windowed(a, rows, results):
    for name, cfg in windowed_configs():
        if a.only and name not in a.only.split(","):
            continue
        path = os.path.join(a.work, name)
        model = save(cfg, path, a.tokenizer).cuda().eval()
        lines, note = kiln_generate(a.kiln, ["--init-from", path], a.work, name,
                                    prompts=LONG_PROMPTS, tokens=128)
        if lines is None:
            rows.append((name, "kiln refused", note))
            results.append({"model": name, "error": note})
            continue
        same, total, worst = compare(model, lines)
        state = model.state_dict()
        del model
        full = tf.AutoModelForCausalLM.from_config(without_window(cfg), torch_dtype=torch.float32)
        full.load_state_dict(state)
        full = full.cuda().eval()
        control = 0.0
        for line in lines:
            s = line["samples"][0]
            ref = hf_logprobs(full, line["prompt_tokens"], s["tokens"])
            control = max(control, max(abs(x - y) for x, y in zip(ref, s["logprobs"])))
        del full
        torch.cuda.empty_cache()
        longest = max(len(l["prompt_tokens"]) + len(l["samples"][0]["tokens"]) for l in lines)
        rows.append((name, f"{same}/{total} greedy tokens identical",
                     f"max |logprob diff| {worst:.2e}; without the window {control:.2e}; "
                     f"longest sequence {longest}; {note}"))
        results.append({"model": name, "same": same, "total": total, "max_logprob_diff": worst,
                        "control_diff": control, "longest": longest})
        print(rows[-1], flush=True)


def save(cfg, path, tokenizer):
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    # Random weights of the usual scale, and norm gains drawn from [0.5, 1.5] rather than left
    # at the initialiser's 1: kiln's decoder folds the gains into the projections after them,
    # which gains of 1 would not test.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or (".ln_" in name and name.endswith(".weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    for f in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, f), path)
    return model


def kiln_generate(kiln, args, work, name, prompts=PROMPTS, tokens=64):
    texts = prompts
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w") as f:
        for p in texts:
            f.write(json.dumps({"prompt": p}) + "\n")
    out = os.path.join(work, f"{name}.kiln.jsonl")
    r = subprocess.run([kiln, "generate", *args, "--prompts", prompts, "--out", out,
                        "--temperature", "0", "--tokens", str(tokens), "--precision", "fp32"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
    return [json.loads(l) for l in open(out)], r.stderr.strip().splitlines()[-1]


def hf_logprobs(model, ids, new):
    """Log-probabilities transformers gives each of `new` after `ids` (teacher forcing)."""
    x = torch.tensor([ids + new], device="cuda")
    with torch.no_grad():
        logits = model(x).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    n = len(ids)
    return [lp[n - 1 + i, t].item() for i, t in enumerate(new)]


def compare(model, lines):
    same, total, worst = 0, 0, 0.0
    for line in lines:
        ids = line["prompt_tokens"]
        s = line["samples"][0]
        with torch.no_grad():
            g = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=len(s["tokens"]),
                               min_new_tokens=len(s["tokens"]), do_sample=False, pad_token_id=0)
        hf_tokens = g[0, len(ids):].tolist()
        total += len(s["tokens"])
        agree = next((i for i, (a, b) in enumerate(zip(hf_tokens, s["tokens"])) if a != b),
                     len(s["tokens"]))
        same += agree
        ref = hf_logprobs(model, ids, s["tokens"])
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, s["logprobs"])))
    return same, total, worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    ap.add_argument("--work", default="/tmp/kiln-parity")
    ap.add_argument("--only", default="")
    ap.add_argument("--gguf", default="", help="a GGUF model compared as it is (real weights)")
    ap.add_argument("--windowed", action="store_true",
                    help="the sliding-window configurations (Mistral, Qwen2) only")
    ap.add_argument("--json", default="", help="write the windowed rows as JSON here")
    ap.add_argument("--long-prompts", action="store_true",
                    help="prompts of about 100 tokens for the full-attention models, whose "
                         "prefill then runs through the packed training attention on a GPU")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    rows = []
    if a.windowed:
        results = []
        run_windowed(a, rows, results)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
        print("\n| model | tokens | detail |\n|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} |")
        return 0
    if a.gguf:
        name = os.path.basename(a.gguf)
        hf_dir = os.path.join(a.work, "gguf-exported")
        subprocess.run([a.kiln, "export", "--init-from", a.gguf, "--to", hf_dir], check=True)
        model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).cuda().eval()
        # In the chat template: given a raw prompt the instruct model's greedy first token is
        # often its end-of-turn token, which would leave nothing to compare.
        lines, note = kiln_generate(a.kiln, ["--init-from", a.gguf, "--chat"], a.work, "gguf")
        if lines is None:
            rows.append((name, "kiln refused", note))
        else:
            same, total, worst = compare(model, lines)
            rows.append((name, f"{same}/{total} greedy tokens identical",
                         f"max |logprob diff| {worst:.2e}; {note}"))
        del model
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)
    for name, cfg in configs():
        if a.only and name not in a.only.split(","):
            continue
        path = os.path.join(a.work, name)
        model = save(cfg, path, a.tokenizer).cuda().eval()
        lines, note = kiln_generate(a.kiln, ["--init-from", path], a.work, name,
                                    prompts=LONG_PROMPTS if a.long_prompts else PROMPTS)
        if lines is None:
            rows.append((name, "kiln refused", note))
        else:
            same, total, worst = compare(model, lines)
            rows.append((name, f"{same}/{total} greedy tokens identical",
                         f"max |logprob diff| {worst:.2e}; {note}"))
        del model
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)

    # Export: train the SmolLM2-shaped model two steps on the GPU, export, reload.
    if not a.only or "export" in a.only:
        src = os.path.join(a.work, "smollm2-135m")
        if not os.path.isdir(src):
            save(configs()[1][1], src, a.tokenizer)
        run = os.path.join(a.work, "run")
        shutil.rmtree(run, ignore_errors=True)
        r = subprocess.run([a.kiln, "train", "--init-from", src, "--out", run, "--device", "cuda",
                            "train.precision=fp32", "train.steps=2", "train.seq_len=128",
                            "train.micro_batch=2", "train.eval_batches=1", "-q"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            rows.append(("export", "kiln train failed", r.stderr.strip()[-300:]))
        else:
            exp = os.path.join(a.work, "exported")
            subprocess.run([a.kiln, "export", "--run", run, "--to", exp], check=True)
            lines, note = kiln_generate(a.kiln, ["--run", run], a.work, "export")
            model = tf.AutoModelForCausalLM.from_pretrained(exp, torch_dtype=torch.float32).cuda().eval()
            same, total, worst = compare(model, lines)
            rows.append(("export (trained run)", f"{same}/{total} greedy tokens identical",
                         f"max |logprob diff| {worst:.2e}"))
    print("\n| model | tokens | detail |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    sys.exit(main())
