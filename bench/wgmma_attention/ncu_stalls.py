"""One kernel's warp-stall reasons and busiest pipes from Nsight Compute's CSV (ncu.sh).

  python3 ncu_stalls.py NCU_CSV
"""
import csv
import sys

from ncu_source import number


def main(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        print("no metrics in", path)
        return
    head = rows[0]
    name, unit, value = head.index("Metric Name"), head.index("Metric Unit"), head.index("Metric Value")
    stalls, pipes = [], []
    for r in rows[1:]:
        metric = r[name]
        v = number(r[value])
        if metric.startswith("smsp__average_warps_issue_stalled_"):
            # Each reason comes as `.ratio` (warps per issued instruction), `.pct` and `.max_rate`.
            reason, _, suffix = metric[len("smsp__average_warps_issue_stalled_"):].partition("_per_issue_active")
            if suffix == ".ratio":
                stalls.append((v, reason))
        elif metric.startswith(("sm__pipe_", "sm__inst_executed_pipe_")):
            pipes.append((v, metric))
        elif metric == "gpu__time_duration.sum":
            print(f"duration {v:.1f} {r[unit]}")
    print("stalls (warps per issued instruction): " + ", ".join(f"{r} {v:.2f}" for v, r in sorted(stalls, reverse=True)[:10]))
    for v, m in sorted(pipes, reverse=True)[:8]:
        print(f"  {v:6.1f}%  {m}")


if __name__ == "__main__":
    main(sys.argv[1])
