"""Training throughput of Hugging Face LlamaForCausalLM or GPT2LMHeadModel (SDPA attention,
bf16 autocast, fused AdamW), eager or with torch.compile, at a published model's shape from
random weights: the baseline `kiln train` is compared against in the same command.

    python3 bench/hf_llama_train.py --shape smollm2-135m --batch 16 --seq 1024 [--compile]
        [--lora R] [--data FILE] [--vocab V]
    torchrun --standalone --nproc-per-node N bench/hf_llama_train.py ... [--zero1]

Under torchrun the model is wrapped in DistributedDataParallel (each rank its own batch of
--batch rows; --zero1 shards the AdamW moments with ZeroRedundancyOptimizer) and rank 0 prints
tokens/s over all ranks and per GPU, and its own peak memory.

Prints one JSON line: tokens/s (median over the timed steps), peak memory, the bytes of the
frozen weights, and the loss of every step. With --data the batches come from FILE (int32;
per step, the inputs then the targets, each [batch, seq], as `kiln bench finetune` writes
them); otherwise random token ids.
"""

import argparse
import json
import os
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
# GPT2LMHeadModel shapes: LoRA there targets its Conv1D projections.
GPT2_SHAPES = {
    "gpt2-small": dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES) + list(GPT2_SHAPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--lora", type=int, default=0,
                    help="PEFT LoRA of this rank on every block projection over a frozen base")
    ap.add_argument("--data", default=None,
                    help="int32 batches: per step, inputs then targets, each [batch, seq]")
    ap.add_argument("--vocab", type=int, default=None, help="override the shape's vocabulary")
    ap.add_argument("--profile-step", type=int, default=-1,
                    help="bracket this step (0-based, warm-up included) with cudaProfilerStart/Stop, "
                         "for `ncu --profile-from-start off`")
    ap.add_argument("--zero1", action="store_true",
                    help="under torchrun: shard the optimizer state (ZeroRedundancyOptimizer)")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1:
        import torch.distributed as dist
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
    torch.manual_seed(0)
    gpt2 = a.shape in GPT2_SHAPES
    shape = dict(GPT2_SHAPES[a.shape] if gpt2 else SHAPES[a.shape])
    if a.vocab:
        shape["vocab_size"] = a.vocab
    if gpt2:
        cfg = tf.GPT2Config(**shape, attn_implementation="sdpa")
        model = tf.GPT2LMHeadModel(cfg).cuda()
        targets = ["c_attn", "c_proj", "c_fc"]
    else:
        cfg = tf.LlamaConfig(**shape, attn_implementation="sdpa")
        model = tf.LlamaForCausalLM(cfg).cuda()
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if a.lora:
        import peft
        lc = peft.LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0,
                             target_modules=targets)
        model = peft.get_peft_model(model, lc)
    params = [p for p in model.parameters() if p.requires_grad]
    if world > 1 and a.zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4, fused=True)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    step_fn = model
    if world > 1:
        step_fn = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    if a.compile:
        step_fn = torch.compile(step_fn)
    steps = a.warmup + a.steps
    if a.data:
        import numpy as np
        raw = np.fromfile(a.data, dtype=np.int32)
        want = steps * 2 * a.batch * a.seq
        if raw.size < want:
            raise SystemExit(f"{a.data} holds {raw.size} ids, {want} needed for {steps} steps")
        data = torch.from_numpy(raw[:want].astype(np.int64)).view(steps, 2, a.batch, a.seq).cuda()
    else:
        g = torch.Generator(device="cpu").manual_seed(1 + rank)
        x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g).cuda()
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        torch.cuda.synchronize()
        if i == a.profile_step:
            torch.cuda.profiler.start()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if a.data:
                # Targets come shifted already (the model's own loss would shift them again).
                logits = step_fn(input_ids=data[i, 0]).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.float().view(-1, logits.size(-1)), data[i, 1].reshape(-1))
            else:
                loss = step_fn(input_ids=x[:, :-1], labels=x[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == a.profile_step:
            torch.cuda.profiler.stop()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    tps = a.batch * a.seq * world / statistics.median(times)
    if rank == 0:
        print(json.dumps({
            "engine": "transformers" + (" + PEFT LoRA r%d" % a.lora if a.lora else "")
                      + (" + torch.compile" if a.compile else " eager")
                      + (" + DDP" if world > 1 else "") + (" + ZeRO-1" if world > 1 and a.zero1 else ""),
            "shape": a.shape, "vocab": cfg.vocab_size, "batch": a.batch, "seq": a.seq, "world": world,
            "tokens_per_s": round(tps), "tokens_per_s_per_gpu": round(tps / world),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_bytes": torch.cuda.max_memory_allocated(), "base_weight_bytes": frozen,
            "losses": losses,
        }), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
