# Summaries for run.sh.
#   summary.py ptxas PTXAS_LOG            registers and spills of each Hopper configuration
#   summary.py times HARNESS_LOG SDPA_LOG  the harness's times beside SDPA's, one table a shape
import re
import sys


def ptxas(path):
    name = None
    spill = ""
    for line in open(path):
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spill = m.group(0)
        m = re.search(r"Used (\d+) registers", line)
        if m and name and name.startswith(("wg_", "wp_")):
            print(f"ptxas {name:24s} {m.group(1):>3s} registers, {spill}")
            name = None


def times(harness, sdpa):
    # (T, hs, dtype) -> {column: us}
    table, columns, engine = {}, [], set()
    for line in open(harness):
        m = re.match(r"time B \d+ T (\d+) NH +\d+ hs +(\d+) (.+?) +([\d.]+) us", line)
        if not m:
            continue
        T, hs, name, us = int(m.group(1)), int(m.group(2)), m.group(3).strip(), float(m.group(4))
        dtype = "f16" if "f16" in name.replace("bf16", "") else "bf16"
        col = "mma.sync" if name.startswith("tc ") else re.sub(r"^w([gs])_b?f16_hs\d+_", r"w\1 ", name)
        if "[engine]" in line:
            engine.add((hs, col))
        table.setdefault((T, hs, dtype), {})[col] = us
        if (hs, col) not in [(h, c) for h, c in columns]:
            columns.append((hs, col))
    try:
        for line in open(sdpa):
            m = re.match(r"sdpa B \d+ T (\d+) NH +\d+ hs +(\d+) (\w+) +(\w+) +([\d.]+) us", line)
            if not m:
                continue
            T, hs, dt, backend, us = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4), float(m.group(5))
            dtype = "bf16" if dt == "bfloat16" else "f16"
            col = "SDPA " + backend
            table.setdefault((T, hs, dtype), {})[col] = us
            if (hs, col) not in columns:
                columns.append((hs, col))
    except OSError:
        pass
    print("times in us (B 8, causal); * = the engine's configuration")
    for hs in sorted({k[1] for k in table}):
        cols = [c for h, c in columns if h == hs]
        head = [c + ("*" if (hs, c) in engine else "") for c in cols]
        print(f"\nhs {hs:3d}        " + " ".join(f"{c:>16s}" for c in head))
        for key in sorted(k for k in table if k[1] == hs):
            row = table[key]
            cells = " ".join(f"{row[c]:16.1f}" if c in row else f"{'-':>16s}" for c in cols)
            print(f"T {key[0]:4d} {key[2]:5s}   {cells}")


if __name__ == "__main__":
    if sys.argv[1] == "ptxas":
        ptxas(sys.argv[2])
    else:
        times(sys.argv[2], sys.argv[3])
