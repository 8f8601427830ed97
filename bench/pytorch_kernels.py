"""PyTorch timings of the operations `kiln bench kernels` times, at the same sizes.

Run on the same GPU in the same command as `kiln bench kernels`, so the two tables compare
(a ratio from one run is a result; an absolute time from another day is not). Eager PyTorch:
each line is the operation as a PyTorch training step would call it.
"""

import argparse

import torch
import torch.nn.functional as F


def median_us(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--params", type=int, default=124_475_904)
    a = ap.parse_args()
    n, c, v = a.rows, a.channels, a.vocab
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []

    for dt, name in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
        x = torch.randn(n, c, device=dev, dtype=dt)
        d = torch.randn(n, c, device=dev, dtype=dt)
        g = torch.randn(c, device=dev, dtype=dt)
        b = torch.randn(c, device=dev, dtype=dt)
        rows.append(("residual + layer_norm fwd", name, median_us(lambda: F.layer_norm(x + d, (c,), g, b))))
        xr = (x + d).requires_grad_(True)
        gr = g.clone().requires_grad_(True)
        br = b.clone().requires_grad_(True)
        out = F.layer_norm(xr, (c,), gr, br)
        dy = torch.randn_like(out)
        rows.append(("layer_norm bwd", name, median_us(lambda: torch.autograd.grad(out, (xr, gr, br), dy, retain_graph=True))))
        h = torch.randn(n, 4 * c, device=dev, dtype=dt)
        rows.append(("gelu tanh fwd", name, median_us(lambda: F.gelu(h, approximate="tanh"))))
        hr = h.clone().requires_grad_(True)
        ho = F.gelu(hr, approximate="tanh")
        hd = torch.randn_like(ho)
        rows.append(("gelu tanh bwd", name, median_us(lambda: torch.autograd.grad(ho, hr, hd, retain_graph=True))))
        logits = torch.randn(n, v, device=dev, dtype=dt).requires_grad_(True)
        tgt = torch.randint(0, v, (n,), device=dev)

        def ce():
            loss = F.cross_entropy(logits.float() if dt == torch.float32 else logits, tgt)
            torch.autograd.grad(loss, logits)

        rows.append(("cross_entropy fwd+bwd", name, median_us(ce)))
        del logits
        wte = torch.randn(v, c, device=dev, dtype=dt, requires_grad=True)
        tok = torch.randint(0, v, (n,), device=dev)
        rows.append(("embedding fwd", name, median_us(lambda: F.embedding(tok, wte))))
        eo = F.embedding(tok, wte)
        ed = torch.randn_like(eo)
        rows.append(("embedding bwd", name, median_us(lambda: torch.autograd.grad(eo, wte, ed, retain_graph=True))))

    for label, dt, tf32 in [("f32", torch.float32, False), ("tf32", torch.float32, True), ("bf16", torch.bfloat16, False)]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for name, cin, cout in [("qkv", c, 3 * c), ("fc", c, 4 * c), ("proj", 4 * c, c), ("lm_head", c, v)]:
            x = torch.randn(n, cin, device=dev, dtype=dt)
            w = torch.randn(cout, cin, device=dev, dtype=dt)
            b = torch.randn(cout, device=dev, dtype=dt)
            us = median_us(lambda: F.linear(x, w, b))
            rows.append((f"linear fwd {name}", label, us, 2 * n * cin * cout / (us * 1e-6) / 1e12))
    torch.backends.cuda.matmul.allow_tf32 = False

    p = torch.randn(a.params, device=dev, requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    rows.append(("AdamW fused (f32 only)", "f32", median_us(opt.step)))
    rows.append(("grad norm (vector_norm)", "f32", median_us(lambda: torch.linalg.vector_norm(p.grad))))

    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print(f"{'operation':<28} | {'dtype':<5} | {'median us':>10} | note")
    print("-" * 64)
    for r in rows:
        note = f"{r[3]:.1f} TFLOP/s" if len(r) > 3 else ""
        print(f"{r[0]:<28} | {r[1]:<5} | {r[2]:>10.1f} | {note}")


if __name__ == "__main__":
    main()
