#!/usr/bin/env python3
"""Per-step kernel time from an ncu CSV (gpu__time_duration.sum): steps end at each AdamW
launch (the last kernel of a step's update); prints the chosen step's kernels grouped by name."""
import csv, sys, collections, re
path, step = sys.argv[1], int(sys.argv[2])
rows = []
with open(path) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    v = float(r["Metric Value"].replace(",", ""))
    unit = r.get("Metric Unit", "ns")
    us = v / 1000 if unit in ("nsecond", "ns") else (v if unit in ("usecond", "us") else v * 1000)
    rows.append((int(r["ID"]), r["Kernel Name"], us))
rows.sort()
steps, cur = [], []
for _, name, us in rows:
    cur.append((name, us))
    if "adamw" in name.lower():
        steps.append(cur); cur = []
print(f"{len(rows)} kernels, {len(steps)} steps ending in adamw; kernels per step:", [len(s) for s in steps], "after the last:", len(cur))
s = [(n, us) for n, _, us in [(r[1], 0, r[2]) for r in rows]] if step < 0 else steps[step]
groups = collections.defaultdict(lambda: [0, 0.0])
for name, us in s:
    key = re.sub(r"\(.*", "", name)[:70]
    groups[key][0] += 1; groups[key][1] += us
total = sum(us for _, us in s)
print(f"step {step}: {len(s)} kernels, {total/1000:.2f} ms of kernel time")
for k, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
    print(f"{us/1000:8.3f} ms {100*us/total:5.1f}% {n:4d}x  {k}")
