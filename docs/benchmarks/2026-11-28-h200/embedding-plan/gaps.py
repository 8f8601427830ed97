# Idle gaps in the last part of an nsys sqlite export: which ops surround them, and the CUDA
# API calls in the same window (syncs, copies, allocations) by name.
import collections, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
frac = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
S = dict(db.execute("select id, value from StringIds"))
iv = []
for s, e, n in db.execute("select start, end, shortName from CUPTI_ACTIVITY_KIND_KERNEL"):
    iv.append((s, e, S.get(n, "?")[:40]))
for t, lab in (("CUPTI_ACTIVITY_KIND_MEMCPY", "memcpy"), ("CUPTI_ACTIVITY_KIND_MEMSET", "memset")):
    try:
        for s, e, k, b in db.execute(f"select start, end, copyKind, bytes from {t}" if lab == "memcpy" else f"select start, end, 0, bytes from {t}"):
            iv.append((s, e, f"{lab}{k}:{b}" if b < 4096 else f"{lab}{k}:big"))
    except sqlite3.OperationalError:
        pass
iv.sort()
lo = iv[int(len(iv) * (1 - frac))][0]; hi = max(e for _, e, _ in iv)
cur_e, prev = None, None; idle = 0; pairs = collections.defaultdict(lambda: [0, 0]); hist = collections.Counter()
for s, e, name in iv:
    if s < lo: continue
    if cur_e is not None and s > cur_e:
        g = s - cur_e; idle += g
        b = "<2us" if g < 2000 else "2-5us" if g < 5000 else "5-20us" if g < 20000 else "20-100us" if g < 100000 else ">100us"
        hist[b] += g
        if g >= 5000:
            p = pairs[(prev, name)]; p[0] += 1; p[1] += g
    if cur_e is None or e > cur_e: cur_e = e
    prev = name
win = hi - lo
emb = [(e - s) for s, e, n in iv if s >= lo and "embedding_backward" in n]
if emb:
    print(f"embedding_backward kernels: {len(emb)}, {sum(emb)/len(emb)/1e3:.1f} us each")
print(f"window {win/1e6:.2f} ms, idle {idle/1e6:.3f} ms ({idle/win*100:.1f}%); idle by gap size (ms): " + ", ".join(f"{k} {v/1e6:.3f}" for k, v in sorted(hist.items())))
for (a, b), (n, g) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:14]:
    print(f"  {g/1e6:7.3f} ms {n:5d}x  {a} -> {b}")
try:
    api = collections.defaultdict(lambda: [0, 0])
    for s, e, n in db.execute("select start, end, nameId from CUPTI_ACTIVITY_KIND_RUNTIME where start >= ?", (lo,)):
        a = api[S.get(n, "?")]; a[0] += 1; a[1] += e - s
    print("  api calls in the window (count, host ms): " + "; ".join(f"{k} {n} {t/1e6:.2f}" for k, (n, t) in sorted(api.items(), key=lambda kv: -kv[1][1])[:12]))
except sqlite3.OperationalError as x:
    print("no runtime table", x)
