#!/usr/bin/env python3
"""Chat fine-tuning data from the bundled corpus: each example is a speech (the user's cue)
and the speech that follows it in the play (the assistant's reply), as JSON lines of
{"messages": [...]}. Consecutive speeches by different speakers within a scene only.

usage: shakespeare_chat.py CORPUS OUT.jsonl [MAX_EXAMPLES] [MAX_CHARS]
"""
import json
import re
import sys

corpus, out = sys.argv[1], sys.argv[2]
limit = int(sys.argv[3]) if len(sys.argv) > 3 else 4000
max_chars = int(sys.argv[4]) if len(sys.argv) > 4 else 400
speaker = re.compile(r"^([A-Z][A-Z' ,&-]+)\.$")
system = "You are a character in a play by Shakespeare. Answer the cue in verse or prose as the next speaker would."

speeches = []  # (speaker, text) or None at scene breaks
name, lines = None, []
for raw in open(corpus, encoding="utf-8"):
    line = raw.rstrip("\n")
    m = speaker.match(line.strip())
    if line.startswith("SCENE") or line.startswith("ACT "):
        if name and lines:
            speeches.append((name, " ".join(lines)))
        speeches.append(None)
        name, lines = None, []
    elif m and not line.startswith(" "):
        if name and lines:
            speeches.append((name, " ".join(lines)))
        name, lines = m.group(1), []
    elif line.strip() == "":
        if name and lines:
            speeches.append((name, " ".join(lines)))
            name, lines = None, []
    elif name and not line.strip().startswith("["):
        lines.append(line.strip())

n = 0
with open(out, "w", encoding="utf-8") as f:
    for a, b in zip(speeches, speeches[1:]):
        if a is None or b is None or a[0] == b[0]:
            continue
        if len(a[1]) > max_chars or len(b[1]) > max_chars or len(b[1]) < 20:
            continue
        msgs = [
            {"role": "system", "content": system},
            {"role": "user", "content": a[1]},
            {"role": "assistant", "content": b[1]},
        ]
        f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
        n += 1
        if n >= limit:
            break
print(f"wrote {n} chat examples to {out}", file=sys.stderr)
