#!/usr/bin/env python3
"""Decode steps from an ncu CSV: a step ends at each sample_draw launch; prints one full step's
kernels grouped by name, and the first layer's sequence."""
import csv, sys, collections, re
rows = []
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    v = float(r["Metric Value"].replace(",", ""))
    unit = r.get("Metric Unit", "ns")
    us = v / 1000 if unit in ("nsecond", "ns") else (v if unit in ("usecond", "us") else v * 1000)
    rows.append((int(r["ID"]), re.sub(r"\(.*", "", r["Kernel Name"])[:60], us))
rows.sort()
steps, cur = [], []
for _, name, us in rows:
    cur.append((name, us))
    if "sample_draw" in name:
        steps.append(cur); cur = []
print(f"{len(rows)} kernels, steps of", [len(s) for s in steps])
full = steps[1:] or steps
s = min(full, key=len)  # a decode step: a prefill's has more kernels
total = sum(us for _, us in s)
print(f"decode step: {len(s)} kernels, {total:.1f} us of kernel time")
g = collections.defaultdict(lambda: [0, 0.0])
for n, us in s:
    g[n][0] += 1; g[n][1] += us
for k, (n, us) in sorted(g.items(), key=lambda kv: -kv[1][1]):
    print(f"{us:8.1f} us {100*us/total:5.1f}% {n:4d}x  {us/n:6.2f} each  {k}")
print("sequence, first 16 and last 8:")
for n, us in s[:16] + [("...", 0)] + s[-8:]:
    print(f"  {us:6.2f}  {n}")
