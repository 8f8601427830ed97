#!/usr/bin/env python3
"""First instance of each kernel from an ncu --page details CSV: chosen metrics."""
import csv, sys, collections
path = sys.argv[1]
lines = [l for l in open(path) if l.startswith('"')]
by = collections.OrderedDict()
for r in csv.DictReader(lines):
    k = r["Kernel Name"].split("(")[0]
    i = int(r["ID"])
    d = by.setdefault(k, {"id": i, "m": {}})
    if i != d["id"]:
        continue
    d["m"][r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
keep = ["Duration", "Memory Throughput", "DRAM Throughput", "L1/TEX Hit Rate", "L2 Hit Rate",
        "Achieved Occupancy", "Theoretical Occupancy", "Registers Per Thread", "Block Size", "Grid Size",
        "Waves Per SM", "Warp Cycles Per Issued Instruction", "Issue Slots Busy", "Executed Ipc Active",
        "Mem Busy", "Max Bandwidth", "Block Limit Registers", "Block Limit Shared Mem", "Dynamic Shared Memory Per Block"]
for k, d in by.items():
    m = d["m"]
    print(k)
    print("   " + "; ".join(f"{n} {m[n][0]} {m[n][1]}".strip() for n in keep if n in m))
    stalls = sorted(((float(v[0].replace(",", "")), n) for n, v in m.items() if n.startswith("Stall") or "stall" in n.lower()), reverse=True)[:6]
    if stalls:
        print("   stalls: " + "; ".join(f"{n} {v:.2f}" for v, n in stalls))
