"""Summarises Nsight Compute's SASS source page (CSV) of one kernel: the instructions with the
most warp-stall samples, and the samples summed by stall reason and by opcode.

  python3 ncu_source.py SOURCE_CSV [TOP]
"""
import collections
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(path, top):
    rows = list(csv.reader(open(path, errors="replace")))
    head_at = next((i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r)), None)
    if head_at is None:
        print("no source table in", path, "; first lines:")
        for r in rows[:5]:
            print("  ", r[:8])
        return
    head = [c.strip() for c in rows[head_at]]
    body = [r for r in rows[head_at + 1:] if len(r) == len(head)]
    src = head.index("Source")
    samples = next((i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All")), None)
    if samples is None:
        print("columns:", head)
        return
    reasons = [i for i, c in enumerate(head) if c.startswith("stall_") or "Stall" in c and i != samples]
    total = sum(number(r[samples]) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} stall samples")
    print(f"top {top} instructions by samples (share, address/line, SASS):")
    for r in sorted(body, key=lambda r: -number(r[samples]))[:top]:
        print(f"  {100 * number(r[samples]) / total:5.1f}%  {r[0][:10]:>10s}  {r[src].strip()[:90]}")
    by_op = collections.Counter()
    for r in body:
        op = r[src].strip().split()
        op = [w for w in op if not w.startswith("@")]
        by_op[op[0].split(".")[0] if op else "?"] += number(r[samples])
    print("samples by opcode:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(12)))
    if reasons:
        sums = {head[i]: sum(number(r[i]) for r in body) for i in reasons}
        print("by reason:", ", ".join(f"{k} {v:.0f}" for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:12]))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
