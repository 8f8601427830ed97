#!/usr/bin/env python3
"""One training step's kernels from two or more engines, side by side by kind of work.

Each CSV is Nsight Compute's output (`--csv --metrics gpu__time_duration.sum`) over exactly one
step, taken with `--profile-from-start off` around it (`kiln train --profile-steps N..=N`,
`bench/pytorch_gpt.py --profile-step N`, `bench/hf_llama_train.py --profile-step N`). Kernels
are put into kinds by name (the first pattern that matches, in the order below); a fused Triton
kernel goes to the first kind its name mentions, so the split is a reading aid, and the largest
kernels of each engine are listed by name as well.

    python3 bench/ncu_step_compare.py kiln=kiln.csv compile=torch.csv [--top 30]
"""
import argparse
import collections
import re

from ncu_csv import read_launches

# (kind, pattern on the lower-cased kernel name); attention first, as some of its kernels'
# names mention gemm or softmax.
KINDS = [
    ("attention", r"attention|flash|fmha|sdpa|_attn"),
    ("products", r"gemm|nvjet|xmma|cutlass|splitkreduce|cublas|matmul|_mm_"),
    ("cross-entropy", r"cross_entropy|nll|log_softmax|logsumexp"),
    ("norms", r"layer_?norm|rms_?norm|rsqrt"),
    ("optimizer + clip", r"adam|multi_tensor|sum_squares|foreach|lpnorm|clip"),
    ("bias gradients / column sums", r"column_sum|accumulate_partials|reduce_kernel|red_fused_sum"),
    ("gelu / swiglu / rotary", r"gelu|silu|swiglu|rope|rotary|tanh|mul_sigmoid"),
    ("embedding", r"embedding|index_put|scatter|gather|indexing|embedding_dense"),
]


def read(path):
    """(kernel name, microseconds) of each launch, in order."""
    return [(name, us) for name, us, _ in read_launches(path, "ncu_step_compare")]


def kind(name):
    low = name.lower()
    for k, pat in KINDS:
        if re.search(pat, low):
            return k
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="LABEL=CSV")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    runs = [(r.split("=", 1)[0], read(r.split("=", 1)[1])) for r in a.runs]
    kinds = [k for k, _ in KINDS] + ["other"]
    table = {}
    for label, rows in runs:
        t = collections.defaultdict(lambda: [0, 0.0])
        for name, us in rows:
            t[kind(name)][0] += 1
            t[kind(name)][1] += us
        table[label] = t
    head = "| kind | " + " | ".join(f"{l} ms (kernels)" for l, _ in runs) + " |"
    print(head)
    print("|---|" + "---:|" * len(runs))
    for k in kinds:
        cells = [f"{table[l][k][1] / 1000:.2f} ({table[l][k][0]})" for l, _ in runs]
        print(f"| {k} | " + " | ".join(cells) + " |")
    totals = [f"{sum(us for _, us in rows) / 1000:.2f} ({len(rows)})" for _, rows in runs]
    print("| total | " + " | ".join(totals) + " |")
    for label, rows in runs:
        groups = collections.defaultdict(lambda: [0, 0.0])
        for name, us in rows:
            key = name[:90]
            groups[key][0] += 1
            groups[key][1] += us
        print(f"\n{label}: the {a.top} largest kernels by total time")
        for key, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1])[: a.top]:
            print(f"{us / 1000:8.3f} ms {n:4d}x  [{kind(key)}] {key}")


if __name__ == "__main__":
    main()
