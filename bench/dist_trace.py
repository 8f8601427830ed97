"""Where communication overlaps compute in a traced data-parallel step (`kiln train --gpus N
--trace FILE --trace-steps A..=B`): for one step, the forward+backward span, the collectives on
the NCCL track, how much of their time lies under compute-stream ops, when the first one starts
and how much of them is left exposed after the last compute op of the backward.

    python3 bench/dist_trace.py TRACE.json [TRACE.json ...] [--step S]
Prints one JSON object per trace (the last traced step unless --step names one).
"""

import argparse
import json

PHASES, OPS, COMM = 1, 2, 3


def union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def covered(a, b, merged):
    """Microseconds of [a, b) that lie inside the merged intervals."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)


def summarise(path, step):
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted({e["args"]["step"] for e in events})
    if not steps:
        return {"trace": path, "error": "no traced step"}
    s = step if step is not None else steps[-1]
    ev = [e for e in events if e["args"]["step"] == s]
    span = lambda e: (e["ts"], e["ts"] + e["dur"])
    phases = {e["name"]: span(e) for e in ev if e["tid"] == PHASES}
    ops = [span(e) for e in ev if e["tid"] == OPS]
    comm = [span(e) for e in ev if e["tid"] == COMM]
    fb = next((v for k, v in phases.items() if "forward" in k), None)
    merged_ops = union(ops)
    comm_total = sum(b - a for a, b in comm)
    under = sum(covered(a, b, merged_ops) for a, b in comm)
    last_compute = max((b for a, b in ops if fb is None or b <= fb[1] + 1.0), default=None)
    exposed_after = sum(max(0.0, b - max(a, last_compute)) for a, b in comm) if last_compute else None
    t0 = fb[0] if fb else min(a for a, _ in ops)
    res = {
        "trace": path,
        "step": s,
        "phases_ms": {k: round((b - a) / 1e3, 3) for k, (a, b) in phases.items()},
        "collectives": len(comm),
        "comm_ms": round(comm_total / 1e3, 3),
        "comm_under_compute_ms": round(under / 1e3, 3),
        "overlap_fraction": round(under / comm_total, 3) if comm_total else None,
        "first_collective_at_ms": round((min(a for a, _ in comm) - t0) / 1e3, 3) if comm else None,
        "comm_after_last_compute_ms": round(exposed_after / 1e3, 3) if exposed_after is not None else None,
    }
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("traces", nargs="+")
    p.add_argument("--step", type=int, default=None)
    a = p.parse_args()
    for t in a.traces:
        print(json.dumps(summarise(t, a.step)))


if __name__ == "__main__":
    main()
