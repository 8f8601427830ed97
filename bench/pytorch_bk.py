"""The BK-Core diagonal by the determinant (three-term) recurrence, written plainly in
PyTorch, as the baseline `kiln bench bk` compares against on the same GPU.

theta_k = s_k theta_{k-1} - theta_{k-2} from the left, phi likewise from the right, and
G_ii = theta_{i-1} phi_{i+1} / theta_N (H0 = Laplacian, p = 1, z = i). One Python step per
position, batched over sequences; the backward is autograd's. In complex64 the
determinants overflow for long sequences, which the output reports as the fraction of
non-finite G (the kernel under test has none).

Prints one JSON object: {"torch": version, "device": name, "rows": [{"batch", "n",
"fwd_ms", "fwdbwd_ms", "nonfinite_fraction"}]}.
"""

import argparse
import json
import statistics

import torch


def bk_determinant(v, z):
    b, n = v.shape
    s = (v - 2.0).to(torch.complex64) - z
    one = torch.ones(b, dtype=torch.complex64, device=v.device)
    theta = [one, s[:, 0]]
    for k in range(2, n + 1):
        theta.append(s[:, k - 1] * theta[k - 1] - theta[k - 2])
    phi = [None] * (n + 1)  # phi[k]: determinant of the trailing block from k
    phi[n] = one
    phi[n - 1] = s[:, n - 1]
    for k in range(n - 2, -1, -1):
        phi[k] = s[:, k] * phi[k + 1] - phi[k + 2]
    before = torch.stack(theta[:n], dim=1)  # theta[i]: leading block of size i
    after = torch.stack(phi[1 : n + 1], dim=1)  # phi[i + 1]
    return before * after / theta[n].unsqueeze(1)


def time_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64,512")
    ap.add_argument("--ns", default="128,512,2048,8192")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda")
    z = torch.tensor(1j, dtype=torch.complex64, device=dev)
    rows = []
    for n in [int(x) for x in a.ns.split(",")]:
        for b in [int(x) for x in a.batches.split(",")]:
            g = torch.Generator(device=dev).manual_seed(1)
            v = (torch.rand(b, n, device=dev, generator=g) * 2 - 1).requires_grad_(True)
            # Long sequences cost seconds per call: fewer repetitions there.
            reps = a.reps if n <= 512 else max(2, a.reps // 2)
            with torch.no_grad():
                fwd = time_ms(lambda: bk_determinant(v, z), 1, reps)
                out = bk_determinant(v, z)
                bad = (~torch.isfinite(out.real) | ~torch.isfinite(out.imag)).float().mean().item()

            def fwdbwd():
                out = bk_determinant(v, z)
                (out.real.sum() + out.imag.sum()).backward()
                v.grad = None

            both = time_ms(fwdbwd, 1, reps)
            rows.append(
                {"batch": b, "n": n, "fwd_ms": fwd, "fwdbwd_ms": both, "nonfinite_fraction": bad}
            )
    print(
        json.dumps(
            {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
