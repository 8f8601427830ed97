"""Parity of kiln's Phi-3 import and export with transformers' Phi3ForCausalLM, in one run.

transformers builds random-initialised Phi3ForCausalLM models from published shapes (four
layers each, to keep the run short; the SmolLM2 tokenizer's 49152 ids where Phi-3's own
vocabulary is smaller) and saves them with save_pretrained; kiln imports each directory
(`kiln generate --init-from`, fp32 on the GPU) and decodes 64 greedy tokens for three prompts,
which transformers decodes from the same ids (llama_parity.py's comparison):

- phi-3-mini-4k: width 3072, 32 heads of 96, window 2047, no rotary scaling;
- phi-3.5-mini: the same with LongRoPE (131072 positions over 4096 trained: short factors at
  these lengths, attention factor sqrt(1 + ln 32 / ln 4096));
- phi-4-mini: 24 heads of 128 sharing 8 key/value heads, three quarters of each head rotated,
  LongRoPE, a tied head, 200064 ids.

Then the long factors: a small LongRoPE model trained for 64 positions, run by kiln at a
context of 512 (a one-step run at a learning rate of 1e-30, which leaves every weight as imported) on prompts
of about 100 tokens and 128 new ones, against transformers, which takes the long factors for
every sequence past 64. As a control, the same weights with the long factors replaced by the
short ones score kiln's tokens: that difference must be large. The same run then decodes 128
tokens after short prompts, across the 64 positions: every token's logits are those of a
forward call over the sequence so far (short factors up to 64 positions, long ones after; what
transformers' Phi-3 generation means by computing its cache again at the first step past 64),
which transformers' generate without a cache gives; its cached generate is reported beside it
(--only-long runs these two rows alone).

With --llama-cpp, llama.cpp's own converter writes the phi-3.5-mini and phi-4-mini directories as
f32 GGUF files (architecture phi3: fused projections, LongRoPE factors as tensors), which kiln
decodes against transformers on the directories.

Training at head size 96: a small Phi-3 trained six steps from the same weights, data and seed
in fp32 on the GPU (the unfused attention: f32 has no fused kernel at 96), in bf16-mixed on the
GPU (the mma.sync tensor-core kernels at 96) and in fp32 on the CPU; the losses of every step
compared (--only-training runs this alone).

Last, export: a kiln run trained two steps from phi-3.5-mini is exported (`kiln export`) and
loaded by transformers as Phi3ForCausalLM; its greedy tokens and log-probabilities are compared
with kiln's own from the run.

    python3 bench/phi3_parity.py --kiln target/release/kiln --tokenizer DIR --work /tmp/phi3
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_parity as lp  # noqa: E402

SHORT = [round(1.0 + 0.03 * i, 4) for i in range(48)]
LONG = [round(1.0 + 1.5 * i, 4) for i in range(48)]


def phi3(**kw):
    """A Phi3Config; LongRoPE given as transformers 5's rope_parameters (or, for an older
    transformers, as rope_scaling)."""
    rope = kw.pop("longrope", None)
    theta = kw.pop("rope_theta", 10000.0)
    if rope is None:
        return tf.Phi3Config(rope_parameters={"rope_type": "default", "rope_theta": theta}, **kw)
    short, long_, original = rope
    params = {"rope_type": "longrope", "rope_theta": theta, "short_factor": short,
              "long_factor": long_, "original_max_position_embeddings": original}
    if "partial_rotary_factor" in kw:
        params["partial_rotary_factor"] = kw["partial_rotary_factor"]
    try:
        return tf.Phi3Config(rope_parameters=params, original_max_position_embeddings=original, **kw)
    except TypeError:
        return tf.Phi3Config(rope_theta=theta, original_max_position_embeddings=original,
                             rope_scaling={"type": "longrope", "short_factor": short,
                                           "long_factor": long_}, **kw)


def configs():
    common = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=4,
                  rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    mini = phi3(vocab_size=49152, num_attention_heads=32, num_key_value_heads=32,
                max_position_embeddings=4096, sliding_window=2047, tie_word_embeddings=False,
                **common)
    mini35 = phi3(vocab_size=49152, num_attention_heads=32, num_key_value_heads=32,
                  max_position_embeddings=131072, sliding_window=262144,
                  tie_word_embeddings=False, longrope=(SHORT, LONG, 4096), **common)
    phi4mini = phi3(vocab_size=200064, num_attention_heads=24, num_key_value_heads=8,
                    partial_rotary_factor=0.75, max_position_embeddings=131072,
                    sliding_window=262144, tie_word_embeddings=True,
                    longrope=(SHORT, LONG, 4096), **common)
    return [("phi-3-mini-4k", mini), ("phi-3.5-mini", mini35), ("phi-4-mini", phi4mini)]


def long_config(long_factors):
    return phi3(vocab_size=49152, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False,
                longrope=([round(1.0 + 0.02 * i, 4) for i in range(32)], long_factors, 64))


def converter_tokenizer(src):
    """Points llama.cpp's converter at its byte-level BPE path for the directory's tokenizer
    (Phi-3's own path expects a SentencePiece tokenizer.model)."""
    tc = os.path.join(src, "tokenizer_config.json")
    with open(tc) as f:
        t = json.load(f)
    t["tokenizer_class"] = "GPT2Tokenizer"
    with open(tc, "w") as f:
        json.dump(t, f)


def kiln_run(kiln, src, run, extra):
    shutil.rmtree(run, ignore_errors=True)
    return subprocess.run([kiln, "train", "--init-from", src, "--out", run, "--device", "cuda",
                           "train.precision=fp32", "train.micro_batch=2", "train.eval_batches=1",
                           "-q", *extra], capture_output=True, text=True)


def greedy_row(a, rows, row, model, kiln_args, work_name):
    """kiln's greedy tokens (from `kiln_args`) against transformers' `model`, as one row."""
    lines, note = lp.kiln_generate(a.kiln, kiln_args, a.work, work_name)
    if lines is None:
        rows.append((row, "kiln refused", note))
        return
    same, total, worst = lp.compare(model, lines)
    rows.append((row, f"{same}/{total} greedy tokens identical",
                 f"max |logprob diff| {worst:.2e}; {note}"))


def run_models(a, rows):
    """The published shapes, imported from save_pretrained directories."""
    for name, cfg in configs():
        path = os.path.join(a.work, name)
        model = lp.save(cfg, path, a.tokenizer).cuda().eval()
        if name == "phi-3.5-mini":
            rot = model.model.rotary_emb
            want = math.sqrt(1 + math.log(32) / math.log(4096))
            print(f"{name}: transformers' attention scaling {rot.attention_scaling:.6f} "
                  f"(formula {want:.6f})", flush=True)
        greedy_row(a, rows, name, model, ["--init-from", path], name)
        del model
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)


def run_long_context(a, rows):
    """LongRoPE's long factors past the trained context."""
    # Past the trained context: the long factors, in both engines.
    name = "longrope-past-64"
    long_factors = [round(1.0 + 0.5 * i, 4) for i in range(32)]
    path = os.path.join(a.work, name)
    model = lp.save(long_config(long_factors), path, a.tokenizer).cuda().eval()
    run = os.path.join(a.work, "long-run")
    r = kiln_run(a.kiln, path, run, ["model.context=512", "train.seq_len=512", "train.steps=1",
                                     "optim.lr=1e-30", "optim.min_lr=0", "optim.warmup_steps=0",
                                     "optim.weight_decay=0"])
    if r.returncode != 0:
        rows.append((name, "kiln train failed", r.stderr.strip()[-300:]))
    else:
        lines, note = lp.kiln_generate(a.kiln, ["--run", run], a.work, name,
                                       prompts=lp.LONG_PROMPTS, tokens=128)
        if lines is None:
            rows.append((name, "kiln refused", note))
        else:
            same, total, worst = lp.compare(model, lines)
            state = model.state_dict()
            short = tf.AutoModelForCausalLM.from_config(
                long_config([round(1.0 + 0.02 * i, 4) for i in range(32)]),
                torch_dtype=torch.float32)
            short.load_state_dict(state)
            short = short.cuda().eval()
            control = 0.0
            for line in lines:
                s = line["samples"][0]
                ref = lp.hf_logprobs(short, line["prompt_tokens"], s["tokens"])
                control = max(control, max(abs(x - y) for x, y in zip(ref, s["logprobs"])))
            del short
            rows.append((name, f"{same}/{total} greedy tokens identical",
                         f"max |logprob diff| {worst:.2e}; with the short factors instead "
                         f"{control:.2e}; {note}"))
        print(rows[-1], flush=True)
        crossing_row(a, rows, model, run)
    del model
    torch.cuda.empty_cache()
    print(rows[-1], flush=True)


def generate_logprobs(model, ids, n, use_cache=True):
    """transformers' greedy generation of `n` tokens after `ids`: the tokens and the
    log-probability of each under the logits that chose it. Without the cache each step is a
    forward call over the whole sequence so far (LongRoPE's factors chosen by its length)."""
    with torch.no_grad():
        g = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0,
                           use_cache=use_cache, return_dict_in_generate=True,
                           output_logits=True)
    tokens = g.sequences[0, len(ids):].tolist()
    lps = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(g.logits, tokens)]
    return tokens, lps


def crossing_row(a, rows, model, run):
    """Short prompts decoded across the trained 64 positions. transformers' Phi-3 generation
    means every step to take the factors of the whole sequence so far: the short ones up to 64
    positions, then the long ones, its cache dropped and computed again at the first step past
    64 (Phi3ForCausalLM.prepare_inputs_for_generation); generate without a cache, a forward
    call over the sequence for each token, is that reference. kiln decodes the three prompts in
    one batch and transformers each alone. The cached generate is compared too: in
    transformers 5.17 its steps after the recomputation depart from its own forward calls."""
    name = "longrope-crossing-64"
    lines, note = lp.kiln_generate(a.kiln, ["--run", run], a.work, name, prompts=lp.PROMPTS,
                                   tokens=128)
    if lines is None:
        rows.append((name, "kiln refused", note))
        return
    same, total, worst, cached_same, departs = 0, 0, 0.0, 0, 0.0
    for line in lines:
        ids, s = line["prompt_tokens"], line["samples"][0]
        n = len(s["tokens"])
        tokens, lps = generate_logprobs(model, ids, n, use_cache=False)
        total += n
        agree = next((i for i, (x, y) in enumerate(zip(tokens, s["tokens"])) if x != y), n)
        same += agree
        worst = max([worst] + [abs(x - y) for x, y in zip(lps[:agree], s["logprobs"][:agree])])
        c_tokens, c_lps = generate_logprobs(model, ids, n)
        c_agree = next((i for i, (x, y) in enumerate(zip(c_tokens, tokens)) if x != y), n)
        cached_same += c_agree
        # The cached generate against its own forward calls along its own tokens.
        ref = [lp.hf_logprobs(model, ids + c_tokens[:i], [t])[0] for i, t in enumerate(c_tokens)]
        departs = max([departs] + [abs(x - y) for x, y in zip(c_lps, ref)])
    rows.append((name, f"{same}/{total} greedy tokens identical",
                 f"against generate without a cache (a forward call per token), max |logprob "
                 f"diff| {worst:.2e}; generate with its cache: {cached_same}/{total} of the same "
                 f"tokens, its log-probabilities up to {departs:.2e} from its own forward calls; "
                 f"{note}"))


def run_gguf(a, rows):
    """The LongRoPE directories as GGUF files from llama.cpp's converter."""
    # GGUF files written by llama.cpp's own converter from the LongRoPE directories (f32, so
    # the weights are exactly transformers'): kiln reads the file, transformers the directory.
    for name in ["phi-3.5-mini", "phi-4-mini"]:
        src = os.path.join(a.work, name)
        converter_tokenizer(src)
        gguf_file = os.path.join(a.work, f"{name}.f32.gguf")
        env = dict(os.environ, PYTHONPATH=os.path.join(a.llama_cpp, "gguf-py"))
        r = subprocess.run([sys.executable, os.path.join(a.llama_cpp, "convert_hf_to_gguf.py"),
                            src, "--outtype", "f32", "--outfile", gguf_file],
                           capture_output=True, text=True, env=env)
        row = f"{name} GGUF (llama.cpp's converter, f32)"
        if r.returncode != 0:
            rows.append((row, "conversion failed", r.stderr.strip()[-300:]))
            print(rows[-1], flush=True)
            continue
        model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()
        greedy_row(a, rows, row, model, ["--init-from", gguf_file], name + "-gguf")
        del model
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)


def run_training(a, rows):
    """Training at head size 96 on the GPU against the CPU."""
    # The same weights, data and seed, the loss of every step: fp32 on the GPU (f32 at head
    # size 96 runs the unfused attention) and in bf16-mixed (the head-size-96 tensor-core
    # kernels) against fp32 on the CPU.
    name = "train-hs96-gpu-vs-cpu"
    small = phi3(vocab_size=49152, hidden_size=384, intermediate_size=768, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=True, longrope=(SHORT, LONG, 4096))
    path = os.path.join(a.work, name)
    lp.save(small, path, a.tokenizer)
    losses = {}
    for device, precision in [("cuda", "fp32"), ("cpu", "fp32"), ("cuda", "bf16-mixed")]:
        key = f"{device}-{precision}"
        run = os.path.join(a.work, f"hs96-{key}")
        shutil.rmtree(run, ignore_errors=True)
        r = subprocess.run([a.kiln, "train", "--init-from", path, "--out", run, "--device", device,
                            f"train.precision={precision}", "train.steps=6", "train.seq_len=128",
                            "train.micro_batch=2", "train.eval_batches=1", "train.log_every=1",
                            "-q"], capture_output=True, text=True)
        if r.returncode != 0:
            losses[key] = r.stderr.strip()[-300:]
            continue
        losses[key] = [json.loads(l)["loss"] for l in open(os.path.join(run, "metrics.jsonl"))
                          if json.loads(l).get("kind") == "train"]
    if all(isinstance(v, list) for v in losses.values()):
        cpu = losses["cpu-fp32"]
        diff = lambda k: max(abs(x - y) for x, y in zip(losses[k], cpu))  # noqa: E731
        fmt = lambda k: ["%.5f" % x for x in losses[k]]  # noqa: E731
        rows.append((name, f"{len(cpu)} steps",
                     f"GPU fp32 (unfused attention) against the CPU: max |loss diff| "
                     f"{diff('cuda-fp32'):.2e}; GPU bf16-mixed (the head-size-96 tensor-core "
                     f"kernels): {diff('cuda-bf16-mixed'):.2e}; CPU {fmt('cpu-fp32')}; "
                     f"GPU bf16 {fmt('cuda-bf16-mixed')}"))
    else:
        rows.append((name, "kiln train failed", str(losses)))
    print(rows[-1], flush=True)


def run_export(a, rows):
    """A trained run exported and loaded by transformers."""
    # Export: train phi-3.5-mini two steps, export, load in transformers.
    src = os.path.join(a.work, "phi-3.5-mini")
    run = os.path.join(a.work, "run")
    r = kiln_run(a.kiln, src, run, ["train.steps=2", "train.seq_len=128"])
    if r.returncode != 0:
        rows.append(("export", "kiln train failed", r.stderr.strip()[-300:]))
    else:
        exp = os.path.join(a.work, "exported")
        subprocess.run([a.kiln, "export", "--run", run, "--to", exp], check=True)
        lines, note = lp.kiln_generate(a.kiln, ["--run", run], a.work, "export")
        model = tf.AutoModelForCausalLM.from_pretrained(exp, torch_dtype=torch.float32).cuda().eval()
        arch = type(model).__name__
        same, total, worst = lp.compare(model, lines)
        rows.append((f"export (trained run, loaded as {arch})",
                     f"{same}/{total} greedy tokens identical", f"max |logprob diff| {worst:.2e}"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    ap.add_argument("--work", default="/tmp/kiln-phi3")
    ap.add_argument("--only-training", action="store_true",
                    help="only the head-size-96 training check")
    ap.add_argument("--only-long", action="store_true",
                    help="only the LongRoPE checks past and across the trained context")
    ap.add_argument("--llama-cpp", default="",
                    help="a llama.cpp source tree (convert_hf_to_gguf.py, conversion/, gguf-py/): "
                         "its converter writes the LongRoPE models as GGUF files for kiln to read")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    print("transformers", tf.__version__, flush=True)
    rows = []
    if a.only_training:
        run_training(a, rows)
    elif a.only_long:
        run_long_context(a, rows)
    else:
        run_models(a, rows)
        run_long_context(a, rows)
        if a.llama_cpp:
            run_gguf(a, rows)
        run_training(a, rows)
        run_export(a, rows)
    print("\n| model | tokens | detail |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    sys.exit(main())
