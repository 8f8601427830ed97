"""The operations `kiln bench kernels` times, in eager PyTorch, on the same grid of sizes and
the same GPU, for the comparison in that command's report (it runs this script itself).

Each operation is what a PyTorch training step would call for the kernel it stands beside:
`F.layer_norm(x + d)` for the residual layernorm, autograd's backward for the backward
kernels, `F.cross_entropy` forward and forward + backward, `F.scaled_dot_product_attention`
with `is_causal=True` between the usual split/transpose of a `[B, T, 3C]` qkv tensor, `F.linear`
in f32, tf32 and bf16, `torch.optim.AdamW(fused=True)` and `torch.linalg.vector_norm`.
PyTorch has no BK-Core operation.

Beside the kernels of kiln's unfused path (`train.fused_kernels=false`) stand the same
operations as eager PyTorch writes them without fused kernels: `torch.add` and `add_`,
`F.log_softmax` (f32) + `F.nll_loss` forward and autograd backward, the head moves
`q.view(B, T, H, hs).transpose(1, 2).contiguous()` and back, `torch.bmm` for `Q K^T` and `P V`
over `[B*H, T, hs]`, a masked `softmax` and its autograd backward, and
`torch.optim.AdamW(foreach=True)`.

Beside kiln's NF4 dequantisation (group `nf4`) stands bitsandbytes'
`bnb.functional.dequantize_4bit` on the same shapes (NF4, blocks of 64, double-quantised
absmax) when bitsandbytes imports, otherwise the same arithmetic in eager PyTorch (a lookup of
the 16 NF4 values and of the restored absmax, a multiply, a cast to bf16), and `F.linear` in
bf16 for the GEMM the workspace feeds.

Beside kiln's pairwise cosine diversity (group `diversity`) stands what a PyTorch
implementation writes: `F.normalize`, the Gram matrix `u @ u.T` and the mean of `1 - G` over
the upper triangle (`triu(G, 1).sum()`), and its autograd backward, for one set of n
embeddings of width d.

The attention rows replay each call from a CUDA graph, so that their time is the device's
(SDPA's kernels and the layout copies around them) without eager autograd's host time between
launches, which at T 1024 made PyTorch's forward + backward row up to 1.9x its kernels' time;
kiln's side launches its own kernels back to back.

Timing matches the kiln side: inputs rotated through enough copies that a call never finds
its data left in L2 by the one before (working sets under twice the L2 size, `--l2-bytes`,
at most `--max-copies`), `--warmup` untimed calls, then the median of `--reps` samples of
CUDA events, each sample several calls back to back divided by their count.

`--json` prints one object: {"torch", "device", "rows": [{"kernel", "dtype", "size", "ms",
"op"}], "skipped": [...]}; without it, a table. `--device cpu` runs the same code on the CPU
(wall-clock timing), a quick check of the script on a machine without a GPU.
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# A sample runs calls back to back until it holds about this much work, at most MAX_CALLS.
SAMPLE_MS = 1.0
MAX_CALLS = 16
# Idle seconds before each kernel's timing, as kiln's suite pauses (src/bench/kernels.rs,
# "Settling"): a long GEMM before it lowers the SM clock under the power limit.
SETTLE_S = 0.2


def copies_for(working_set, l2_bytes, max_copies):
    """Copies needed so that the others touched between two uses of one exceed 2 x L2."""
    evict = 2 * l2_bytes
    if working_set >= evict or l2_bytes == 0:
        return 1
    return min(math.ceil(evict / max(working_set, 1)) + 1, max_copies)


class Bench:
    def __init__(self, a):
        self.a = a
        self.dev = torch.device(a.device if a.device == "cpu" else f"cuda:{a.gpu}")
        self.cuda = self.dev.type == "cuda"
        self.rows = []
        self.skipped = []
        # Inputs come from a generator of their own: the default one is registered with every
        # captured CUDA graph (the attention rows'), after which PyTorch refuses to advance it
        # outside a capture.
        self.gen = torch.Generator(device=self.dev)
        self.gen.manual_seed(0)

    def rand(self, *shape, dtype=torch.float32, scale=1.0, grad=False):
        t = (torch.rand(*shape, device=self.dev, dtype=torch.float32, generator=self.gen) * 2 - 1) * scale
        return t.to(dtype).requires_grad_(grad)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def sample_ms(self, fn, calls):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e3 / calls

    def median_ms(self, fn):
        if self.cuda:
            self.sync()
            time.sleep(SETTLE_S)
        for _ in range(self.a.warmup):
            fn()
        self.sync()
        one = max(self.sample_ms(fn, 1), 1e-4)
        calls = max(1, min(MAX_CALLS, math.ceil(SAMPLE_MS / one)))
        return statistics.median(self.sample_ms(fn, calls) for _ in range(self.a.reps))

    def graphs(self, calls):
        """One CUDA graph of each call (no arguments), warmed up on a side stream first."""
        side = torch.cuda.Stream(device=self.dev)
        side.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(side):
            for c in calls:
                for _ in range(2):
                    c()
        torch.cuda.current_stream(self.dev).wait_stream(side)
        out = []
        for c in calls:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                c()
            out.append(g)
        return out

    def run(self, kernel, dtype, size, op, working_set, make, fn, graphed=False):
        """Times `fn(*s)` cycling over copies `s = make()`; a failure is listed, not fatal.

        `graphed`: each copy's call is captured in a CUDA graph and the graphs are replayed,
        so that the time is the device's alone, as kiln's kernels' (eager autograd's host time
        between launches otherwise counts at small sizes); where capture fails, eager calls
        are timed and the row says so."""
        try:
            k = copies_for(working_set, self.a.l2_bytes, self.a.max_copies)
            sets = [make() for _ in range(k)]
            i = [0]
            replays = None
            if graphed and self.cuda:
                try:
                    replays = self.graphs([lambda s=s: fn(*s) for s in sets])
                    op = op + " (CUDA graph)"
                except Exception as e:  # an operation that cannot be captured
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    op = op + f" (eager: capture failed: {first[:80]})"

            def call():
                j = i[0] % k
                i[0] += 1
                return replays[j].replay() if replays is not None else fn(*sets[j])

            ms = self.median_ms(call)
            self.rows.append({"kernel": kernel, "dtype": dtype, "size": size, "ms": ms, "op": op})
        except Exception as e:  # out of memory, or an operation this build lacks
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.skipped.append(f"{kernel} {dtype} at {size}: {type(e).__name__}: {first}")
        finally:
            sets = None
            if self.cuda:
                torch.cuda.empty_cache()


def rowwise(b, n, name, dt):
    a = b.a
    c, v, seq = a.channels, a.vocab, a.seq
    es = torch.tensor([], dtype=dt).element_size()
    act, stats = es * n * c, 8 * n
    g, beta = b.rand(c, dtype=dt), b.rand(c, dtype=dt)

    b.run("layernorm_forward", name, n, "F.layer_norm(x)", 2 * act + stats,
          lambda: (b.rand(n, c, dtype=dt, scale=2),),
          lambda x: F.layer_norm(x, (c,), g, beta))
    b.run("residual_layernorm_forward", name, n, "F.layer_norm(x + d)", 4 * act + stats,
          lambda: (b.rand(n, c, dtype=dt, scale=2), b.rand(n, c, dtype=dt, scale=2)),
          lambda x, d: F.layer_norm(x + d, (c,), g, beta))
    gr, br = g.clone().requires_grad_(True), beta.clone().requires_grad_(True)

    def ln_graph():
        x = b.rand(n, c, dtype=dt, scale=2, grad=True)
        out = F.layer_norm(x, (c,), gr, br)
        return out, x, b.rand(n, c, dtype=dt)

    b.run("layernorm_backward", name, n, "autograd of F.layer_norm (x, weight, bias)",
          4 * act + stats, ln_graph,
          lambda out, x, dy: torch.autograd.grad(out, (x, gr, br), dy, retain_graph=True))

    h = 4 * n * c
    b.run("gelu_forward", name, n, "F.gelu(h, approximate='tanh')", 2 * es * h,
          lambda: (b.rand(n, 4 * c, dtype=dt, scale=4),),
          lambda x: F.gelu(x, approximate="tanh"))

    def gelu_graph():
        x = b.rand(n, 4 * c, dtype=dt, scale=4, grad=True)
        return F.gelu(x, approximate="tanh"), x, b.rand(n, 4 * c, dtype=dt)

    b.run("gelu_backward", name, n, "autograd of F.gelu(tanh)", 3 * es * h, gelu_graph,
          lambda out, x, dy: torch.autograd.grad(out, x, dy, retain_graph=True))

    logits = es * n * v

    def ce_inputs(grad):
        return (b.rand(n, v, dtype=dt, scale=4, grad=grad),
                torch.randint(0, v, (n,), device=b.dev, generator=b.gen))

    b.run("cross_entropy_forward", name, n, "F.cross_entropy(reduction='none')",
          logits + stats, lambda: ce_inputs(False),
          lambda x, t: F.cross_entropy(x, t, reduction="none"))
    b.run("cross_entropy_fused", name, n, "F.cross_entropy forward + backward",
          2 * logits + stats, lambda: ce_inputs(True),
          lambda x, t: torch.autograd.grad(F.cross_entropy(x, t), x))

    wte = b.rand(v, c, dtype=dt, grad=True)
    wpe = b.rand(seq, c, dtype=dt, grad=True)
    pos = torch.arange(n, device=b.dev) % seq
    pos_rows = min(n, seq)

    def embed(tok):
        return F.embedding(tok, wte) + F.embedding(pos, wpe)

    def tokens():
        return torch.randint(0, v, (n,), device=b.dev, generator=b.gen)

    with torch.no_grad():
        b.run("embedding_forward", name, n, "F.embedding(tok, wte) + F.embedding(pos, wpe)",
              2 * act + es * pos_rows * c + 4 * n, lambda: (tokens(),), embed)

    def emb_graph():
        return embed(tokens()), b.rand(n, c, dtype=dt)

    b.run("embedding_backward", name, n, "autograd of the embedding sum (wte, wpe)",
          act + 4 * n, emb_graph,
          lambda out, dy: torch.autograd.grad(out, (wte, wpe), dy, retain_graph=True))


def row_ops(b, n, name, dt):
    c = b.a.channels
    es = torch.tensor([], dtype=dt).element_size()
    act, per_row = es * n * c, 8 * n

    def perm():
        return torch.randperm(n, device=b.dev, generator=b.gen)

    b.run("gather_rows", name, n, "src[idx] * scale[:, None]", 2 * act + per_row,
          lambda: (b.rand(n, c, dtype=dt), perm(), b.rand(n, dtype=dt)),
          lambda src, idx, s: src.index_select(0, idx) * s[:, None])
    b.run("scatter_add_rows", name, n, "dst.index_add_(0, idx, src * scale[:, None])",
          3 * act + per_row,
          lambda: (b.rand(n, c, dtype=dt), b.rand(n, c, dtype=dt), perm(), b.rand(n, dtype=dt)),
          lambda dst, src, idx, s: dst.index_add_(0, idx, src * s[:, None]))
    b.run("gathered_row_dot", name, n, "(a[idx] * b).sum(-1, dtype=float32)", 2 * act + per_row,
          lambda: (b.rand(n, c, dtype=dt), perm(), b.rand(n, c, dtype=dt)),
          lambda ta, idx, tb: (ta.index_select(0, idx) * tb).sum(-1, dtype=torch.float32))


def attention(b, n, name, dt):
    a = b.a
    c, t, nh = a.channels, a.seq, a.heads
    bsz, hs = n // t, c // nh
    es = torch.tensor([], dtype=dt).element_size()
    working_set = es * 4 * n * c + 4 * bsz * nh * t

    def sdpa(qkv):
        q, k, v = qkv.split(c, dim=2)
        q, k, v = (x.view(bsz, t, nh, hs).transpose(1, 2) for x in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(bsz, t, c)

    with torch.no_grad():
        b.run("attention_forward", name, n, "F.scaled_dot_product_attention(is_causal=True)",
              working_set, lambda: (b.rand(bsz, t, 3 * c, dtype=dt),), sdpa, graphed=True)

    def graph():
        qkv = b.rand(bsz, t, 3 * c, dtype=dt, grad=True)
        return sdpa(qkv), qkv, b.rand(bsz, t, c, dtype=dt)

    # SDPA's bf16 backward alone fails to capture (PyTorch 2.11 on an H200, in the default and
    # the relaxed error modes, on a second attempt too), so its row times eager calls and says
    # so; the forward + backward row captures in both types and is the one to compare.
    b.run("attention_backward", name, n, "autograd of SDPA (causal)", working_set, graph,
          lambda out, qkv, dy: torch.autograd.grad(out, qkv, dy, retain_graph=True), graphed=True)
    b.run("attention_forward+backward", name, n, "SDPA (causal) forward + autograd backward",
          working_set,
          lambda: (b.rand(bsz, t, 3 * c, dtype=dt, grad=True), b.rand(bsz, t, c, dtype=dt)),
          lambda qkv, dy: torch.autograd.grad(sdpa(qkv), qkv, dy), graphed=True)


def gemm_modes(name):
    """The row labels of the GEMMs of one activation type, with whether tf32 is on."""
    return [("f32", False), ("tf32", True)] if name == "f32" else [(name, False)]


def linears(b, n, name, dt):
    a = b.a
    c, v = a.channels, a.vocab
    es = torch.tensor([], dtype=dt).element_size()
    for label, tf32 in gemm_modes(name):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for layer, cin, cout in [("qkv", c, 3 * c), ("fc", c, 4 * c), ("proj", 4 * c, c),
                                 ("lm_head", c, v)]:
            working_set = es * (n * cin + cout * cin + n * cout + cout)

            def params(grad, cin=cin, cout=cout):
                return (b.rand(n, cin, dtype=dt, grad=grad), b.rand(cout, cin, dtype=dt, grad=grad),
                        b.rand(cout, dtype=dt, grad=grad))

            with torch.no_grad():
                b.run(f"linear_forward {layer}", label, n, "F.linear(x, w, b)", working_set,
                      lambda: params(False), F.linear)

            def graph(cout=cout):
                x, w, bias = params(True)
                return F.linear(x, w, bias), x, w, bias, b.rand(n, cout, dtype=dt)

            b.run(f"linear_backward {layer}", label, n, "autograd of F.linear (x, w, b)",
                  working_set, graph,
                  lambda out, x, w, bias, dy: torch.autograd.grad(out, (x, w, bias), dy,
                                                                  retain_graph=True))
    torch.backends.cuda.matmul.allow_tf32 = False


def unfused(b, n, name, dt):
    """The operations of kiln's unfused path; attention's only over whole sequences."""
    a = b.a
    c, v, t, nh = a.channels, a.vocab, a.seq, a.heads
    es = torch.tensor([], dtype=dt).element_size()
    act = es * n * c

    def two():
        return b.rand(n, c, dtype=dt), b.rand(n, c, dtype=dt)

    with torch.no_grad():
        b.run("add", name, n, "torch.add(a, b)", 3 * act, two, torch.add)
        b.run("add_assign", name, n, "dst.add_(src)", 3 * act, two, lambda d, s: d.add_(s))

    def ce_inputs():
        return (b.rand(n, v, dtype=dt, scale=4, grad=True),
                torch.randint(0, v, (n,), device=b.dev, generator=b.gen))

    def ce(x, tg):
        return torch.autograd.grad(F.nll_loss(F.log_softmax(x, -1, dtype=torch.float32), tg), x)

    b.run("cross_entropy_unfused", name, n,
          "F.nll_loss(F.log_softmax(x, -1, dtype=float32), t) + autograd backward",
          2 * es * n * v + 8 * n * v + 16 * n, ce_inputs, ce)
    if n % t:
        return

    bsz, hs = n // t, c // nh
    bh = bsz * nh
    with torch.no_grad():
        b.run("heads_from_rows", name, n, "q.view(B, T, H, hs).transpose(1, 2).contiguous()",
              2 * act, lambda: (b.rand(bsz, t, 3 * c, dtype=dt),),
              lambda qkv: qkv[:, :, :c].view(bsz, t, nh, hs).transpose(1, 2).contiguous())
        b.run("heads_to_rows", name, n, "o.transpose(1, 2).contiguous().view(B, T, C)",
              2 * act, lambda: (b.rand(bsz, nh, t, hs, dtype=dt),),
              lambda o: o.transpose(1, 2).contiguous().view(bsz, t, c))
        tt = bh * t * t
        for label, tf32 in gemm_modes(name):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            b.run("matmul_batched QK^T", label, n, "torch.bmm(q, k.transpose(1, 2))",
                  es * (2 * n * c + tt),
                  lambda: (b.rand(bh, t, hs, dtype=dt), b.rand(bh, t, hs, dtype=dt)),
                  lambda q, k: torch.bmm(q, k.transpose(1, 2)))
            b.run("matmul_batched PV", label, n, "torch.bmm(p, v)", es * (2 * n * c + tt),
                  lambda: (b.rand(bh, t, t, dtype=dt), b.rand(bh, t, hs, dtype=dt)), torch.bmm)
        torch.backends.cuda.matmul.allow_tf32 = False

    mask = torch.ones(t, t, dtype=torch.bool, device=b.dev).triu(1)
    prefix = bh * t * (t + 1) // 2

    def softmax(s):
        return s.masked_fill(mask, float("-inf")).softmax(-1)

    with torch.no_grad():
        b.run("causal_softmax", name, n, "s.masked_fill(causal_mask, -inf).softmax(-1)",
              es * (prefix + tt), lambda: (b.rand(bh, t, t, dtype=dt, scale=4),), softmax)

    def softmax_graph():
        s = b.rand(bh, t, t, dtype=dt, scale=4, grad=True)
        return softmax(s), s, b.rand(bh, t, t, dtype=dt)

    b.run("causal_softmax_backward", name, n, "autograd of masked_fill + softmax",
          es * (2 * prefix + tt), softmax_graph,
          lambda p, s, dp: torch.autograd.grad(p, s, dp, retain_graph=True))


def optimizer(b):
    p = b.a.params

    def adamw(**how):
        def make():
            w = b.rand(p, grad=True)
            w.grad = b.rand(p)
            opt = torch.optim.AdamW([w], lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                    weight_decay=0.1, **how)
            return (opt,)
        return make

    b.run("adamw_update", "f32", p, "torch.optim.AdamW(fused=True).step()", 28 * p,
          adamw(fused=True), lambda opt: opt.step())
    b.run("adamw_update_unfused", "f32", p, "torch.optim.AdamW(foreach=True).step()", 48 * p,
          adamw(foreach=True), lambda opt: opt.step())
    b.run("sum_squares", "f32", p, "torch.linalg.vector_norm(g)", 4 * p,
          lambda: (b.rand(p),), torch.linalg.vector_norm)


NF4_TOKENS = 8192
NF4_SHAPES = ((2048, 8192), (8192, 2048))


def nf4(b):
    """NF4 dequantisation into bf16 and the bf16 GEMM it feeds, at kiln's shapes."""
    try:
        import bitsandbytes.functional as bnbf
    except Exception as e:  # not installed, or no build for this CUDA
        bnbf = None
        b.skipped.append(f"bitsandbytes ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                         "nf4_dequantize compared with the eager PyTorch lookup instead")
    dev = b.dev
    nf4_values = torch.tensor([
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], device=dev)
    dyn_map = torch.linspace(-1, 1, 256, device=dev)
    for rows, cols in NF4_SHAPES:
        n = rows * cols
        blocks = n // 64
        key = f"nf4_dequantize {rows}x{cols}"
        ws = n // 2 + blocks + 4 * ((blocks + 255) // 256) + 2 * n
        if bnbf is not None and b.cuda:
            def make_bnb(rows=rows, cols=cols):
                w = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16, generator=b.gen) * 0.02
                return bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")

            b.run(key, "bf16", NF4_TOKENS, "bnb.functional.dequantize_4bit", ws, make_bnb,
                  lambda q, state: bnbf.dequantize_4bit(q, state))
        else:
            def make_torch(n=n, blocks=blocks):
                packed = torch.randint(0, 256, (n // 2,), dtype=torch.uint8, device=dev, generator=b.gen)
                codes = torch.randint(0, 256, (blocks,), dtype=torch.uint8, device=dev, generator=b.gen)
                scales = torch.rand((blocks + 255) // 256, device=dev, generator=b.gen) * 0.1
                return packed, codes, scales

            def dequant(packed, codes, scales, rows=rows, cols=cols):
                absmax = dyn_map[codes.long()] * scales.repeat_interleave(256)[: codes.numel()] + 0.01
                idx = torch.stack((packed >> 4, packed & 15), -1).view(-1).long()
                return (nf4_values[idx].view(-1, 64) * absmax[:, None]).to(torch.bfloat16).view(rows, cols)

            b.run(key, "bf16", NF4_TOKENS, "eager lookup, multiply, cast (no bitsandbytes)", ws,
                  make_torch, dequant)

        def make_gemm(rows=rows, cols=cols):
            return (b.rand(NF4_TOKENS, cols, dtype=torch.bfloat16),
                    b.rand(rows, cols, dtype=torch.bfloat16, scale=0.02))

        b.run(f"linear_forward nf4 {rows}x{cols}", "bf16", NF4_TOKENS, "F.linear (bf16)",
              2 * (NF4_TOKENS * (rows + cols) + n), make_gemm, F.linear)


DIVERSITY_N = (8, 64, 512, 4096)
DIVERSITY_D = (64, 256, 1024)


def diversity(b, name, dt):
    """Normalise, Gram matrix and upper-triangle mean of 1 - cos, and its autograd backward."""
    es = torch.tensor([], dtype=dt).element_size()
    for d in DIVERSITY_D:
        for n in DIVERSITY_N:
            pairs = n * (n - 1) / 2

            def value(e, pairs=pairs):
                u = F.normalize(e, dim=-1)
                return 1 - (u @ u.T).triu(1).sum(dtype=torch.float32) / pairs

            ws = es * (n * d + n * n)
            b.run(f"diversity_forward d{d}", name, n,
                  "F.normalize, u @ u.T, 1 - triu(G, 1).sum() / pairs", ws,
                  lambda n=n, d=d: (b.rand(n, d, dtype=dt),), value)

            def graph(n=n, d=d):
                e = b.rand(n, d, dtype=dt, grad=True)
                return value(e), e

            b.run(f"diversity_backward d{d}", name, n, "autograd of the same", 2 * ws, graph,
                  lambda v, e: torch.autograd.grad(v, e, retain_graph=True))


GROUPS = ("memory", "compute", "unfused", "other", "nf4", "diversity")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--rows", default="2048,8192,32768")
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--params", type=int, default=124_475_904)
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--l2-bytes", type=int, default=None,
                    help="L2 size for the rotation (default: the device's)")
    ap.add_argument("--max-copies", type=int, default=256)
    ap.add_argument("--only", default=",".join(GROUPS),
                    help="groups to time, comma-separated: " + ", ".join(GROUPS))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"torch {torch.__version__} sees no CUDA device")
        torch.cuda.set_device(a.gpu)
        props = torch.cuda.get_device_properties(a.gpu)
        device_name = props.name
        if a.l2_bytes is None:
            a.l2_bytes = getattr(props, "L2_cache_size", 0)
    else:
        device_name = "cpu"
        a.l2_bytes = a.l2_bytes or 0
    names = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    for d in names:
        if d not in DTYPES:
            raise SystemExit(f"--dtypes: unknown type {d!r}; use f32, bf16 or f16")
    rows = [int(x) for x in a.rows.split(",")]
    only = {g.strip() for g in a.only.split(",") if g.strip()}
    for g in only:
        if g not in GROUPS:
            raise SystemExit(f"--only: unknown group {g!r}; use {', '.join(GROUPS)}")
    torch.manual_seed(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    b = Bench(a)
    for name in names:
        dt = DTYPES[name]
        for n in rows:
            if "memory" in only:
                rowwise(b, n, name, dt)
                row_ops(b, n, name, dt)
            if "compute" in only:
                if n % a.seq == 0:
                    # f32 under both labels, as the GEMMs: SDPA runs the same kernel either way
                    # (CUTLASS's memory-efficient one, three tf32 products per f32 product).
                    for label, tf32 in gemm_modes(name):
                        torch.backends.cuda.matmul.allow_tf32 = tf32
                        attention(b, n, label, dt)
                    torch.backends.cuda.matmul.allow_tf32 = False
                linears(b, n, name, dt)
            if "unfused" in only:
                unfused(b, n, name, dt)
    if "other" in only:
        optimizer(b)
        b.skipped.append("bk_core_forward, bk_core_backward: PyTorch has no BK-Core operation")
    if "nf4" in only:
        nf4(b)
    if "diversity" in only:
        for name in names:
            diversity(b, name, DTYPES[name])
    out = {"torch": torch.__version__, "device": device_name, "rows": b.rows,
           "skipped": b.skipped}
    if a.json:
        print(json.dumps(out))
        return
    print(f"torch {torch.__version__} on {device_name}")
    print(f"{'kernel':<30} {'dtype':<5} {'size':>10} {'median us':>11}  op")
    for r in b.rows:
        us = r["ms"] * 1e3
        print(f"{r['kernel']:<30} {r['dtype']:<5} {r['size']:>10} {us:>11.1f}  {r['op']}")
    for s in b.skipped:
        print(f"skipped: {s}")


if __name__ == "__main__":
    main()
