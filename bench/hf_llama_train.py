"""Training throughput of Hugging Face LlamaForCausalLM (SDPA attention, bf16 autocast, fused
AdamW), eager or with torch.compile, at a published model's shape from random weights: the
baseline `kiln train` is compared against in the same command.

    python3 bench/hf_llama_train.py --shape smollm2-135m --batch 16 --seq 1024 [--compile]

Prints one JSON line: tokens/s (median over the timed steps), peak memory.
"""

import argparse
import json
import statistics
import time

import torch
import transformers as tf

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                         tie_word_embeddings=True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m", choices=SHAPES)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--lora", type=int, default=0,
                    help="PEFT LoRA of this rank on q/k/v/o/gate/up/down over a frozen base")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**SHAPES[a.shape], attn_implementation="sdpa")
    model = tf.LlamaForCausalLM(cfg).cuda()
    if a.lora:
        import peft
        lc = peft.LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"])
        model = peft.get_peft_model(model, lc)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    step_fn = model
    if a.compile:
        step_fn = torch.compile(model)
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), device="cuda")
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = step_fn(input_ids=x[:, :-1], labels=x[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    tps = a.batch * a.seq / statistics.median(times)
    print(json.dumps({
        "engine": "transformers" + (" + PEFT LoRA r%d" % a.lora if a.lora else "")
                  + (" + torch.compile" if a.compile else " eager"),
        "shape": a.shape, "batch": a.batch, "seq": a.seq,
        "tokens_per_s": round(tps), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }))


if __name__ == "__main__":
    main()
