"""Per-op totals of a kiln Chrome trace (`kiln train --trace FILE`, `kiln finetune --trace`).

Sums the ops track (device-event times on a GPU) by op name: total microseconds, count, and
microseconds a call, largest first, after the step phases of the traced steps. Used to find
where a step's time goes, e.g. the LoRA and rotary-embedding entries of docs/perf-log.md.

    python3 bench/trace_ops.py trace.json [more.json ...]
"""
import collections
import json
import sys


def main(paths):
    for path in paths:
        d = json.load(open(path))
        ev = d["traceEvents"] if isinstance(d, dict) else d
        phases = [(e["name"], round(e["dur"])) for e in ev if e.get("tid") == 1 and e.get("ph") == "X"]
        ops = collections.defaultdict(lambda: [0.0, 0])
        for e in ev:
            if e.get("tid") == 2 and e.get("ph") == "X":
                o = ops[e["name"]]
                o[0] += e["dur"]
                o[1] += 1
        total = sum(v[0] for v in ops.values())
        print(f"== {path}: phases (us) {phases}; ops total {total:.0f} us")
        for name, (t, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:30]:
            print(f"{t:10.0f} us {n:6d}x {t / n:8.1f} us/op  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
