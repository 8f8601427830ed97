"""Generation speed of Hugging Face transformers `generate` (bf16, SDPA, sampling) at a
published model's shape from random weights, or from a model directory: the reference
`kiln bench generate` runs beside itself in the same command.

    python3 bench/hf_generate.py --shape smollm2-135m --batches 1,8,64 \
        --prompt-len 64 --new-tokens 128 --temperature 0.9 --top-p 0.9 --top-k 0

Each batch runs `batch` prompts of random token ids, after an untimed warm-up: once with one
new token (the prefill: prompts' forward and the first token) and once with all of them, no
stop token. Prefill tokens/s = prompt tokens / the first time; decode tokens/s = the other
new tokens / the difference. Prints one JSON line per batch.
"""

import argparse
import json
import time

import torch
import transformers as tf

from hf_llama_train import SHAPES


def load(a):
    if a.model:
        return tf.AutoModelForCausalLM.from_pretrained(
            a.model, torch_dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    cfg = tf.LlamaConfig(**SHAPES[a.shape], attn_implementation="sdpa")
    with torch.device("cuda"):
        return tf.LlamaForCausalLM(cfg).to(torch.bfloat16)


def timed_generate(model, ids, new_tokens, a):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m", choices=SHAPES)
    ap.add_argument("--model", help="a Hugging Face model directory instead of --shape")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = load(a).eval()
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size
    for batch in [int(b) for b in a.batches.split(",")]:
        ids = torch.randint(0, vocab, (batch, a.prompt_len), device="cuda")
        timed_generate(model, ids, 2, a)
        prefill = timed_generate(model, ids, 1, a)
        total = timed_generate(model, ids, a.new_tokens, a)
        print(json.dumps({
            "engine": "transformers",
            "batch": batch,
            "prefill_tokens_per_s": batch * a.prompt_len / prefill,
            "decode_tokens_per_s": batch * (a.new_tokens - 1) / max(total - prefill, 1e-9),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        }), flush=True)


if __name__ == "__main__":
    main()
