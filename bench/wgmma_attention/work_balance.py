#!/usr/bin/env python3
"""How evenly the persistent attention forward's work orders share the key tiles among blocks.

wg_forward_persist (src/engine/cuda/attention_wgmma.cu) runs as many blocks as SMs, each
walking the work tiles (one query tile of one head each) in the order its ORDER parameter
gives; the kernel ends with its busiest block. This replays each order on the CPU for a causal
shape and prints each block's sum of key tiles: the busiest block's sum over the mean bounds
what balance alone can take off (a key tile's cost is most of a work tile's; each tile's Q
load and output store are not counted). Orders, as in the kernel:

  heads     tile w: query tile qtiles-1-w//BNH of head w%BNH; block i takes i, i+G, i+2G, ...
  snake     the same tiles; block i takes position i of even rounds and G-1-i of odd ones
  sections  the snake over sections of heads whose K and V fill about 24 MiB
  sections-rr  sections without the snake (measured 2026-12-03, not kept)
  dyn-heads, dyn-sections  the heads' or the sections' tiles handed out by a counter
            (WG_ORDER_COUNTER, WG_ORDER_COUNTER_SECTIONS), each to the block that comes free
            first (a key tile's time a unit)

  python3 bench/wgmma_attention/work_balance.py --batch 4 --heads 12 --head-size 64 --seq 4096
"""
import argparse
import heapq


def key_tiles(T, HS, BNH, blocks, order):
    rows = 192 if HS == 64 else 128  # consumers x 64 (the engine's WgPersistShape)
    keys = 128
    qtiles = (T + rows - 1) // rows
    work = qtiles * BNH
    section = max(1, (24 << 20) // (T * HS * 4)) if "sections" in order else BNH
    snake = order in ("snake", "sections")

    def tiles_of(w):
        sec = w // (qtiles * section)
        heads = min(section, BNH - sec * section)
        r = w - sec * qtiles * section
        q0 = (qtiles - 1 - r // heads) * rows
        return min(q0 + rows - 1, T - 1) // keys + 1

    if order.startswith("dyn-"):
        free = [(0, i) for i in range(blocks)]  # (when the block comes free, the block)
        loads = [0] * blocks
        for w in range(work):
            t, i = heapq.heappop(free)
            loads[i] = t + tiles_of(w)
            heapq.heappush(free, (loads[i], i))
        return loads
    loads = []
    for i in range(blocks):
        total, w, k = 0, i, 0
        while w < work:
            total += tiles_of(w)
            k += 1
            w = k * blocks + (blocks - 1 - i if snake and k % 2 else i)
        loads.append(total)
    return loads


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-size", type=int, default=64, choices=(64, 128))
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--sms", type=int, default=132, help="blocks (the GPU's SMs; H100/H200: 132)")
    args = ap.parse_args()
    bnh = args.batch * args.heads
    print(f"B {args.batch}, {args.heads} heads of {args.head_size}, {args.sms} blocks: "
          "busiest block's key tiles over the mean")
    for T in args.seq:
        cells = []
        for order in ("heads", "snake", "sections", "sections-rr", "dyn-heads", "dyn-sections"):
            loads = key_tiles(T, args.head_size, bnh, args.sms, order)
            cells.append(f"{order} {max(loads) / (sum(loads) / len(loads)):.3f}")
        print(f"T {T:5d}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
