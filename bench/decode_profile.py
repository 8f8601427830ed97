#!/usr/bin/env python3
"""One decode step's kernels from an Nsight Compute CSV (`ncu --csv`, one row per kernel and
metric, as bench/decode_profile.sh writes it).

A step ends where the sampler's last stage is followed by a kernel that is not the sampler's
(the stages a step launches depend on the sampling settings and the batch: at 32 rows or more
with top-p the select stage draws and `sample_draw` is not launched). The shortest whole step
after the first is a decode step (a prefill has more kernels). For that step it prints each
kernel name's count and time, and, where the CSV has warp-stall metrics
(`smsp__average_warps_issue_stalled_<reason>_per_issue_active`: warps stalled for that reason
per issued instruction), each name's largest stall reasons, averaged over its launches in the
step and weighted by their time.

    python3 bench/decode_profile.py ncu.csv [--top 6]
"""
import argparse
import collections
import sys

from ncu_csv import read_launches as read_csv


def read_launches(path):
    """Launches in order: (name, at most 60 characters, microseconds, {stall reason: value})."""
    return [(name[:60], us, stalls) for name, us, stalls in read_csv(path, "decode_profile")]


def steps_of(launches):
    """Splits the launches where a sampler stage is followed by another kernel."""
    steps, current = [], []
    for i, launch in enumerate(launches):
        current.append(launch)
        nxt = launches[i + 1][0] if i + 1 < len(launches) else None
        if launch[0].startswith("sample_") and (nxt is None or not nxt.startswith("sample_")):
            steps.append(current)
            current = []
    return steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=6, help="stall reasons shown per kernel")
    args = ap.parse_args()
    launches = read_launches(args.csv)
    steps = steps_of(launches)
    if not steps:
        sys.exit("decode_profile: no sampler launch in the CSV, so no whole step")
    print(f"{len(launches)} kernels, whole steps of {[len(s) for s in steps]} kernels")
    step = min(steps[1:] or steps, key=len)
    total = sum(us for _, us, _ in step)
    print(f"decode step: {len(step)} kernels, {total:.1f} us of kernel time")
    groups = collections.OrderedDict()
    for name, us, stalls in step:
        g = groups.setdefault(name, [0, 0.0, collections.Counter()])
        g[0] += 1
        g[1] += us
        for reason, v in stalls.items():
            g[2][reason] += v * us
    for name, (n, us, stalls) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{us:8.1f} us {100 * us / total:5.1f}% {n:4d}x {us / n:7.2f} each  {name}")
        if stalls:
            top = stalls.most_common(args.top)
            print("          stalled warps per issue: "
                  + ", ".join(f"{reason} {v / us:.2f}" for reason, v in top))
    print("sequence, first 16 and last 8:")
    shown = step[:16] + [("...", 0.0, {})] + step[-8:] if len(step) > 24 else step
    for name, us, _ in shown:
        print(f"  {us:6.2f}  {name}")


if __name__ == "__main__":
    main()
