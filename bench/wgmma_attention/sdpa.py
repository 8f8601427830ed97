# PyTorch SDPA forward timings at the harness's shapes (causal, bf16 and f16): the default
# backend choice and each backend alone, q/k/v as contiguous [B, NH, T, HS]; CUDA events
# around single calls, median.
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(8, 1024, 12, 64), (8, 1024, 16, 128), (8, 4096, 12, 64), (8, 4096, 16, 128)]
BACKENDS = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def time_us(fn, reps):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000.0)
    ts.sort()
    return ts[len(ts) // 2]


print("torch", torch.__version__, torch.cuda.get_device_name())
for B, T, NH, HS in SHAPES:
    for dt in (torch.bfloat16, torch.float16):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, NH, T, HS, device="cuda", dtype=dt, generator=g) for _ in range(3))
        flops = 4.0 * B * NH * T * (T + 1) / 2 * HS
        for name, be in BACKENDS:
            def call():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            try:
                if be is None:
                    us = time_us(call, 30 if T > 1024 else 100)
                else:
                    with sdpa_kernel([be]):
                        us = time_us(call, 30 if T > 1024 else 100)
                print(f"sdpa B {B} T {T} NH {NH:2d} hs {HS:3d} {str(dt)[6:]:8s} {name:9s} {us:8.1f} us "
                      f"{flops / us * 1e-6:6.1f} TFLOP/s")
            except Exception as e:  # a backend that does not take this shape or type
                print(f"sdpa B {B} T {T} NH {NH:2d} hs {HS:3d} {str(dt)[6:]:8s} {name:9s} n/a ({type(e).__name__})")
