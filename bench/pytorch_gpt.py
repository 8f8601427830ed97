"""PyTorch reference for `kiln bench train`: the same GPT, timed the same way.

The model matches kiln's GPT exactly in shape: learned position embeddings, pre-norm blocks
with a fused QKV projection, GELU (tanh), biases everywhere, a final layernorm and a head tied
to the token embedding. Modes: fp32, tf32, bf16 autocast (eager) and bf16 autocast with
torch.compile, fp16 autocast with a GradScaler (eager) and the same with torch.compile. Prints one JSON object per mode: tokens/s (median step after warm-up), MFU
against the GPU's dense peak, and peak allocated memory.

    python3 bench/pytorch_gpt.py --batch 8 --seq 1024 --modes fp32,tf32,bf16,bf16-compile

Under torchrun it trains with DistributedDataParallel (NCCL, default buckets), each rank on its
own batches of --batch sequences; tokens/s then counts every rank's tokens and rank 0 prints:

    torchrun --nproc-per-node 2 bench/pytorch_gpt.py --modes bf16,bf16-compile
"""

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c)
        self.fc = nn.Linear(c, 4 * c)
        self.fc_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, context, c, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(context, c)
        self.blocks = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if n.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def peak_flops(name, mode):
    """Dense tensor-core peak of the GPU for the mode's math (H100/H200 SXM figures)."""
    hopper = "H100" in name or "H200" in name
    if not hopper:
        return float("nan")
    return {"fp32": 67e12, "tf32": 494.5e12}.get(mode, 989.4e12)


def finite_or_none(x):
    """JSON has no NaN: an unknown GPU's MFU is null."""
    return x if math.isfinite(x) else None


def load_batches(args):
    """Inputs and targets of every step, shape (steps, 2, batch, seq): read from --data (raw
    little-endian int32, as `kiln bench train` writes its own batches) or drawn at random."""
    n = args.steps + args.warmup
    shape = (n, 2, args.batch, args.seq)
    if args.data:
        with open(args.data, "rb") as f:
            raw = bytearray(f.read())
        flat = torch.frombuffer(raw, dtype=torch.int32)
        if flat.numel() != math.prod(shape):
            raise SystemExit(f"--data {args.data}: {flat.numel()} tokens, expected {shape}")
        return flat.view(shape).long()
    g = torch.Generator(device="cpu").manual_seed(1 + RANK)
    rows = torch.randint(0, args.vocab, (n, args.batch, args.seq + 1), generator=g)
    return torch.stack((rows[:, :, :-1], rows[:, :, 1:]), dim=1)


WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))


def run(mode, args):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    dev = f"cuda:{LOCAL_RANK}"
    model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    wrapped = model
    if WORLD > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[LOCAL_RANK])
    step_model = torch.compile(wrapped) if mode.endswith("compile") else wrapped
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode.split("-")[0])
    # fp16 needs loss scaling, as in PyTorch's AMP recipe; bf16 does not.
    scaler = torch.amp.GradScaler("cuda", enabled=half is torch.float16)
    data = load_batches(args).to(dev)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        x, y = data[i, 0], data[i, 1]
        torch.cuda.synchronize()
        if i == args.profile_step:
            torch.cuda.profiler.start()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=half or torch.bfloat16, enabled=half is not None):
            loss = step_model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == args.profile_step:
            torch.cuda.profiler.stop()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    n_params = sum(p.numel() for p in model.parameters())
    tokens = args.batch * args.seq * WORLD
    c, L, T, V = args.d_model, args.layers, args.seq, args.vocab
    flops_per_token = 72 * L * c * c + 6 * c * V + 6 * L * (T + 1) * c
    step = statistics.median(times)
    name = torch.cuda.get_device_name()
    return {
        "engine": "pytorch " + torch.__version__,
        "mode": mode,
        "device": name,
        "params": n_params,
        "tokens_per_s": tokens / step,
        "step_ms": step * 1e3,
        "world": WORLD,
        "tokens_per_s_per_gpu": tokens / step / WORLD,
        "mfu": finite_or_none(flops_per_token * tokens / WORLD / step / peak_flops(name, mode.split("-")[0])),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": losses,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--modes", default="fp32,tf32,bf16,bf16-compile")
    p.add_argument("--data", help="batches to train on (int32 file, steps x 2 x batch x seq)")
    p.add_argument("--profile-step", type=int, default=-1,
                   help="bracket this step (0-based, warm-up included) with cudaProfilerStart/Stop, "
                        "for `ncu --profile-from-start off`")
    args = p.parse_args()
    if WORLD > 1:
        torch.cuda.set_device(LOCAL_RANK)
        dist.init_process_group("nccl")
    for mode in args.modes.split(","):
        result = run(mode, args)
        if RANK == 0:
            print(json.dumps(result), flush=True)
    if WORLD > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
