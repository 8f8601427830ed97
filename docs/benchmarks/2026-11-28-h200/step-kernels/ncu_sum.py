# Sums an ncu --csv metrics dump by kernel: calls, mean duration (us), mean DRAM % of peak, grid.
import csv, collections, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
hdr = rows[0]; rows = rows[1:]
ix = {h: i for i, h in enumerate(hdr)}
k = collections.defaultdict(lambda: collections.defaultdict(list))
for r in rows:
    name = r[ix["Kernel Name"]].split("(")[0][:48]
    try:
        v = float(r[ix["Metric Value"]].replace(",", ""))
    except ValueError:
        continue
    k[name][r[ix["Metric Name"]]].append((v, r[ix["Metric Unit"]]))
out = []
for name, m in k.items():
    d = m.get("gpu__time_duration.sum", [])
    if not d: continue
    us = [v / 1000 if u in ("ns", "nsecond") else v if u in ("us", "usecond") else v * 1000 for v, u in d]
    dr = [v for v, _ in m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", [])]
    g = [v for v, _ in m.get("launch__grid_size", [])]
    out.append((sum(us), len(us), name, sum(dr) / max(len(dr), 1), g[0] if g else 0))
for tot, n, name, dr, g in sorted(out, reverse=True)[:24]:
    print(f"{tot:9.1f} us {n:4d}x {tot/n:8.1f} us  dram {dr:5.1f}%  grid {g:7.0f}  {name}")
