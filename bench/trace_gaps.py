"""Where the GPU waited inside a kiln Chrome trace's forward+backward phases.

Each op on the ops track carries its device span and `queued_us`, how long its work waited
on the device after the host began the op. Between consecutive ops of a phase the device is
idle for `next.start - (prev.start + prev.dur)`; an idle gap before an op whose work did not
queue at all (queued under `--host-bound-us`, default 3) is time the GPU spent waiting for the
host's launches, which a CUDA graph of the phase would give back. Prints, per traced step:
the phase's length, the ops' device time, the idle time, the part of it that was host-bound,
and the ops that most often came after host-bound gaps; with `--by-op`, each op name's count
and device time in the phase as well.

    python3 bench/trace_gaps.py trace.json [--host-bound-us 3] [--by-op]
"""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--host-bound-us", type=float, default=3.0)
    ap.add_argument("--by-op", action="store_true", help="each op name's count and device time")
    a = ap.parse_args()
    d = json.load(open(a.trace))
    ev = d["traceEvents"] if isinstance(d, dict) else d
    phases = [e for e in ev if e.get("tid") == 1 and e.get("ph") == "X"]
    ops = sorted((e for e in ev if e.get("tid") == 2 and e.get("ph") == "X"), key=lambda e: e["ts"])
    for ph in phases:
        if not ph["name"].startswith("forward"):
            continue
        lo, hi = ph["ts"], ph["ts"] + ph["dur"]
        inside = [e for e in ops if lo <= e["ts"] < hi]
        if not inside:
            continue
        busy = idle = host_idle = 0.0
        after = collections.defaultdict(lambda: [0, 0.0])
        by_op = collections.defaultdict(lambda: [0, 0.0])
        end = inside[0]["ts"]
        for e in inside:
            gap = max(0.0, e["ts"] - end)
            idle += gap
            if e["args"].get("queued_us", 1e9) < a.host_bound_us:
                host_idle += gap
                after[e["name"]][0] += 1
                after[e["name"]][1] += gap
            busy += e["dur"]
            by_op[e["name"]][0] += 1
            by_op[e["name"]][1] += e["dur"]
            end = max(end, e["ts"] + e["dur"])
        step = ph["args"].get("step")
        print(f"step {step} {ph['name']}: {ph['dur'] / 1e3:.2f} ms; {len(inside)} ops, device busy "
              f"{busy / 1e3:.2f} ms, idle between ops {idle / 1e3:.2f} ms, of it waiting for the host "
              f"{host_idle / 1e3:.2f} ms; from the phase's start to the first op "
              f"{(inside[0]['ts'] - lo) / 1e3:.2f} ms, after the last {(hi - end) / 1e3:.2f} ms")
        for name, (n, g) in sorted(after.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"    {g:9.1f} us in {n:4d} host-bound gaps before {name}")
        if a.by_op:
            for name, (n, t) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
                print(f"    {t / 1e3:9.3f} ms in {n:4d} calls of {name}")


if __name__ == "__main__":
    main()
