#!/usr/bin/env python3
"""Helpers of bench/encoder_gpu_check.sh: kiln's encoders beside sentence-transformers and
its folds beside scikit-learn, on the GPU machine (torch, sentence-transformers, sklearn).

    encoder_check.py sentences OUT N           N varied texts from the bundled corpus
    encoder_check.py parity MINILM TEXTS KILN_EMB.safetensors KILN_IDS.jsonl KILN_LOG
    encoder_check.py speed MINILM TEXTS BATCH  sentence-transformers encode, fp16 and bf16
    encoder_check.py folds DATA.jsonl METRICS.json K SEED

Each prints PASS/FAIL lines and numbers; parity and folds exit 1 on a FAIL.
"""
import gzip
import json
import random
import re
import sys
import time


def sentences(out, n):
    """Lines of the corpus alone and joined in runs of 2 to 40 (some past 256 tokens, so
    truncation is exercised), short and long, speakers and stage directions included."""
    lines = [l.strip() for l in gzip.open("data/shakespeare.txt.gz", "rt") if l.strip()]
    rng = random.Random(0)
    texts = []
    while len(texts) < n:
        i = rng.randrange(len(lines))
        run = rng.choice([1, 1, 1, 2, 3, 5, 8, 13, 40])
        texts.append(" ".join(lines[i:i + run]))
    with open(out, "w") as f:
        for t in texts:
            f.write(t.replace("\n", " ") + "\n")
    print(f"wrote {len(texts)} texts to {out}")


def read_texts(path):
    return [l.rstrip("\n") for l in open(path)]


def parity(minilm, texts_path, kiln_emb, kiln_ids, kiln_log):
    import torch
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer

    texts = read_texts(texts_path)
    model = SentenceTransformer(minilm, device="cuda")
    ref = model.encode(texts, batch_size=64, convert_to_tensor=True).float()
    got = load_file(kiln_emb)["embeddings"].to(ref.device)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=1)
    worst = int(cos.argmin())
    ok_cos = bool(cos.min() >= 0.9999)
    print(f"{'PASS' if ok_cos else 'FAIL'} embeddings fp32: {len(texts)} texts, min cosine "
          f"{cos.min():.6f} (text {worst}), mean {cos.mean():.6f}, max |diff| "
          f"{(got - ref).abs().max():.2e}")
    tok = model.tokenizer
    mismatched = 0
    longest = model.max_seq_length
    truncated = 0
    for t, line in zip(texts, open(kiln_ids)):
        want = tok(t)["input_ids"]
        truncated += len(want) > longest
        if json.loads(line) != want:
            mismatched += 1
    ok_ids = mismatched == 0
    print(f"{'PASS' if ok_ids else 'FAIL'} token ids: {len(texts) - mismatched}/{len(texts)} "
          f"texts identical to sentence-transformers' tokenizer")
    m = re.search(r"(\d+) truncated to (\d+) tokens", open(kiln_log).read())
    ok_trunc = m is not None and int(m.group(1)) == truncated
    print(f"{'PASS' if ok_trunc else 'FAIL'} truncation: kiln counted "
          f"{m.group(1) if m else '?'} texts past {longest} tokens, sentence-transformers' "
          f"tokenizer {truncated}")
    return ok_cos and ok_ids and ok_trunc


def speed(minilm, texts_path, batch):
    import torch
    from sentence_transformers import SentenceTransformer

    texts = read_texts(texts_path)
    for name, dtype in [("f16", torch.float16), ("bf16", torch.bfloat16)]:
        model = SentenceTransformer(minilm, device="cuda").to(dtype)
        model.encode(texts[:512], batch_size=batch)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.encode(texts, batch_size=batch)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        print(json.dumps({"engine": "sentence-transformers", "precision": name,
                          "batch": batch, "texts": len(texts),
                          "sentences_per_s": round(len(texts) / dt, 1)}))


def leakage(folds, groups, k):
    out = []
    for f in range(k):
        test = {g for g, x in zip(groups, folds) if x == f}
        train = {g for g, x in zip(groups, folds) if x != f}
        out.append(len(test & train))
    return out


def folds(data, metrics, k, seed):
    import numpy as np
    from sklearn.model_selection import StratifiedGroupKFold

    recs = [json.loads(l) for l in open(data) if l.strip()]
    labels = [str(r["label"]) for r in recs]
    groups = [r.get("group", f"#{i}") for i, r in enumerate(recs)]
    kiln = json.load(open(metrics))["assignment"]
    sk = [0] * len(recs)
    splitter = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed)
    for f, (_, test) in enumerate(splitter.split(np.zeros(len(recs)), labels, groups)):
        for i in test:
            sk[i] = f
    classes = sorted(set(labels))
    print(f"{'fold':>4} | {'kiln test size':>14} | kiln share of {classes[-1]!r} | "
          f"{'sklearn test size':>17} | sklearn share of {classes[-1]!r}")
    for f in range(k):
        kt = [l for l, x in zip(labels, kiln) if x == f]
        st = [l for l, x in zip(labels, sk) if x == f]
        share = lambda ls: sum(l == classes[-1] for l in ls) / max(len(ls), 1)
        print(f"{f + 1:>4} | {len(kt):>14} | {share(kt):>20.3f} | {len(st):>17} | "
              f"{share(st):>23.3f}")
    lk, ls = leakage(kiln, groups, k), leakage(sk, groups, k)
    sizes = lambda a: [sum(x == f for x in a) for f in range(k)]
    print(f"fold sizes: kiln {sizes(kiln)}, sklearn {sizes(sk)}")
    ok = sum(lk) == 0 and sum(ls) == 0
    print(f"{'PASS' if ok else 'FAIL'} group leakage: kiln {lk}, sklearn StratifiedGroupKFold {ls}")
    return ok


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "sentences":
        sentences(args[0], int(args[1]))
    elif cmd == "parity":
        sys.exit(0 if parity(*args) else 1)
    elif cmd == "speed":
        speed(args[0], args[1], int(args[2]))
    elif cmd == "folds":
        sys.exit(0 if folds(args[0], args[1], int(args[2]), int(args[3])) else 1)
    else:
        sys.exit(__doc__)
