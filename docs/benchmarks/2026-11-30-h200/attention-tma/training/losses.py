import json, sys
# Every training step's loss and gradient norm of a run's metrics.jsonl, full precision.
out = []
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "train":
        out.append(f"{r['step']}:{r['loss']!r}:{r['grad_norm']!r}")
print(" ".join(out))
