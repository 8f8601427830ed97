"""Compares kiln runs from their metrics.jsonl: per-step losses against a reference run and the
median tokens/s of the steps after warm-up, with the per-rank memory peaks.

    python3 bench/dist_compare.py REF_DIR RUN_DIR [RUN_DIR...] [--bound 0.01] [--skip 5]
Prints one JSON object per run and PASS/FAIL on the loss bound.
"""

import argparse
import json
import statistics
import sys


def records(d):
    out = []
    with open(f"{d}/metrics.jsonl") as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("kind") == "train":
                out.append(r)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ref")
    p.add_argument("runs", nargs="+")
    p.add_argument("--bound", type=float, default=0.01)
    p.add_argument("--skip", type=int, default=5)
    a = p.parse_args()
    ref = {r["step"]: r for r in records(a.ref)}
    ok = True
    for d in [a.ref] + a.runs:
        rs = records(d)
        tps = [r["tokens_per_s"] for r in rs if r["step"] > a.skip]
        pairs = [(abs(r["loss"] - ref[r["step"]]["loss"]) / abs(ref[r["step"]]["loss"]), r["step"], r["loss"], ref[r["step"]]["loss"]) for r in rs if r["step"] in ref]
        diffs = [d for d, *_ in pairs]
        peaks = rs[-1].get("mem_peak_ranks") if rs else None
        worst = max(diffs) if diffs else float("nan")
        at = max(pairs)[1:] if pairs else None
        res = {
            "run": d,
            "steps": len(rs),
            "median_tokens_per_s": statistics.median(tps) if tps else None,
            "first_loss": rs[0]["loss"] if rs else None,
            "last_loss": rs[-1]["loss"] if rs else None,
            "max_rel_loss_diff_vs_ref": worst,
            "worst_step_loss_ref_loss": at,
            "mean_rel_loss_diff_vs_ref": statistics.mean(diffs) if diffs else None,
            "mem_peak_gib": [round(x / 2**30, 3) for x in peaks] if peaks else round(rs[-1]["mem_peak"] / 2**30, 3) if rs else None,
        }
        print(json.dumps(res))
        if d != a.ref:
            good = diffs and worst <= a.bound and len(rs) == len(ref)
            ok &= bool(good)
            print(f"{'PASS' if good else 'FAIL'} losses of {d} within {a.bound} of {a.ref} (max relative difference {worst:.2e})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
