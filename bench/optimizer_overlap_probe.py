"""Does a memory-bound AdamW pass hide under the next step's forward products?

A question asked before building it into the engine: at the Llama-3.2-1B training shape the
optimizer is about 9 ms of a 109 ms step (every parameter's f32 value, gradient and two moments
read, three written, and a bf16 copy written), while the forward that follows is mostly
cuBLAS products that fill every SM. If the update of layer l runs on a second stream while the
forward works on the layers before it (the forward of layer l waiting on an event of its
update), the optimizer's bytes could move while the products compute. Whether they do depends
on whether the GPU runs both kinds of kernel at once: a product kernel that holds an SM's
whole register file leaves no room for another stream's blocks.

Measured here with PyTorch only (no kiln code): 16 layers of the 1B shape's forward products
(8 x 1024 rows: QKV, output, gate/up, down) and, per layer, torch's fused AdamW over that
layer's f32 parameters (plus a bf16 copy written, as kiln's step does), first each alone, then
together in three schedules: one stream (update, then forward), two streams with an event per
layer, two streams with the embedding's update first.

    python3 bench/optimizer_overlap_probe.py
"""

import statistics

import torch

D, F, Q, KV, V, L, ROWS = 2048, 8192, 2048, 512, 128256, 16, 8 * 1024


def layer_params(dev):
    shapes = [(Q + 2 * KV, D), (D, Q), (2 * F, D), (D, F), (D,), (D,)]
    return [torch.randn(s, device=dev) * 0.02 for s in shapes]


def main():
    dev = "cuda"
    torch.manual_seed(0)
    layers = [layer_params(dev) for _ in range(L)]
    emb = [torch.randn(V, D, device=dev) * 0.02]
    groups = [emb] + layers
    for g in groups:
        for p in g:
            p.grad = torch.randn_like(p) * 1e-3
    opts = [torch.optim.AdamW(g, lr=1e-4, fused=True) for g in groups]
    copies = [[p.to(torch.bfloat16) for p in g] for g in groups]
    x = torch.randn(ROWS, D, device=dev, dtype=torch.bfloat16)

    def update(i):
        opts[i].step()
        for c, p in zip(copies[i], groups[i]):
            c.copy_(p)

    def forward_layer(l, h):
        w = copies[l + 1]
        qkv = h @ w[0].t()
        a = qkv[:, :Q] @ w[1].t()
        gu = a @ w[2].t()
        y = gu[:, :F] @ w[3].t()
        return y

    side = torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in groups]

    def run(mode):
        main = torch.cuda.current_stream()
        if mode in ("overlap", "overlap-emb-last"):
            side.wait_stream(main)
            order = list(range(len(groups)))
            if mode == "overlap-emb-last":
                order = order[1:] + [0]
            with torch.cuda.stream(side):
                for i in order:
                    update(i)
                    events[i].record(side)
            h = x
            main.wait_event(events[0]) if mode == "overlap" else None
            for l in range(L):
                main.wait_event(events[l + 1])
                h = forward_layer(l, h)
            main.wait_event(events[0])
            return h
        if mode in ("serial", "update"):
            for i in range(len(groups)):
                update(i)
            if mode == "update":
                return None
        h = x
        for l in range(L):
            h = forward_layer(l, h)
        return h

    def timed(mode, reps=10):
        for _ in range(3):
            run(mode)
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run(mode)
            e.record()
            torch.cuda.synchronize()
            out.append(s.elapsed_time(e))
        return statistics.median(out)

    res = {m: timed(m) for m in ("forward", "update", "serial", "overlap", "overlap-emb-last",
                                 "forward", "update", "serial", "overlap")}
    f, u = res["forward"], res["update"]
    print(f"forward products alone {f:.2f} ms, AdamW alone {u:.2f} ms, sum {f + u:.2f} ms")
    for m in ("serial", "overlap", "overlap-emb-last"):
        print(f"{m:18s} {res[m]:.2f} ms: hides {(f + u - res[m]) / u * 100:.0f}% of the update")


if __name__ == "__main__":
    main()
