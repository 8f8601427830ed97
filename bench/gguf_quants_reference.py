#!/usr/bin/env python3
"""Expected values for the GGUF dequantisation tests of Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q8_K,
IQ4_NL and IQ4_XS.

    python bench/gguf_quants_reference.py > /tmp/expected.rs

Needs `pip install gguf numpy`. Builds the same pseudo-random blocks as
`random_blocks` in src/data/gguf.rs (xorshift64 bytes, then each block's scale fields set to
fixed finite values), dequantises them with `gguf.quants.dequantize` (the numpy dequantisers
of llama.cpp's gguf-py) and prints, per type, the f32 bits of the first block as hex and an
FNV-1a 64 hash of the little-endian f32 bits of every block, as Rust constants to paste into
the test module. gguf-py has no Q8_K dequantiser, so Q8_K's reference is computed here from
ggml's block struct (f32 `d`, 256 int8 codes, 16 int16 sums): `x = d * q`.
"""

import struct

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

MASK = (1 << 64) - 1

# (type, xorshift seed, blocks); the same table as the Rust test.
CASES = [
    (T.Q5_0, 0x5005, 8),
    (T.Q5_1, 0x5105, 8),
    (T.Q2_K, 0x2002, 4),
    (T.Q3_K, 0x3003, 4),
    (T.Q5_K, 0x5005_5005, 4),
    (T.Q8_K, 0x8008, 4),
    (T.IQ4_NL, 0x4A4A, 8),
    (T.IQ4_XS, 0x4B4B, 4),
]


def xorshift_bytes(seed: int, n: int) -> bytearray:
    x, out = seed, bytearray()
    for _ in range(n):
        x ^= (x << 13) & MASK
        x ^= x >> 7
        x ^= (x << 17) & MASK
        out.append(x & 0xFF)
    return out


def random_blocks(qtype: T, seed: int, blocks: int) -> bytes:
    size = GGML_QUANT_SIZES[qtype][1]
    data = xorshift_bytes(seed, blocks * size)
    for b in range(blocks):
        blk = memoryview(data)[b * size:(b + 1) * size]
        d = (0x2147 + 0x0111 * b) | ((b % 2) << 15)
        dmin = 0x1A3B + 0x0105 * b
        m = (0x3400 + 0x0123 * b) | ((b % 3 == 0) << 15)

        def put(at: int, v: int) -> None:
            blk[at:at + 2] = struct.pack("<H", v)

        if qtype == T.Q5_0:
            put(0, d)
        elif qtype == T.Q5_1:
            put(0, d)
            put(2, m)
        elif qtype == T.Q2_K:
            put(80, d)
            put(82, dmin)
        elif qtype == T.Q3_K:
            put(108, d)
        elif qtype == T.Q5_K:
            put(0, d)
            put(2, dmin)
        elif qtype == T.Q8_K:
            blk[0:4] = struct.pack("<I", (0x3B0F5C29 + 0x00123457 * b) | ((b % 2) << 31))
        elif qtype in (T.IQ4_NL, T.IQ4_XS):
            put(0, d)
    return bytes(data)


def reference(qtype: T, data: bytes) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8)
    if qtype == T.Q8_K:
        blocks = raw.reshape(-1, 292)
        d = blocks[:, :4].copy().view(np.float32)
        q = blocks[:, 4:260].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    size = GGML_QUANT_SIZES[qtype][1]
    return dequantize(raw.reshape(-1, size), qtype).astype(np.float32).reshape(-1)


def fnv1a64(values: np.ndarray) -> int:
    h = 0xCBF29CE484222325
    for byte in values.astype("<f4").tobytes():
        h = ((h ^ byte) * 0x100000001B3) & MASK
    return h


def main() -> None:
    for qtype, seed, blocks in CASES:
        y = reference(qtype, random_blocks(qtype, seed, blocks))
        assert np.isfinite(y).all(), qtype.name
        per_block = GGML_QUANT_SIZES[qtype][0]
        hexes = "".join(f"{v:08x}" for v in y[:per_block].view("<u4"))
        print(f"    // {qtype.name}: {blocks} blocks, seed {seed:#x}")
        print(f"    const {qtype.name}_HASH: u64 = {fnv1a64(y):#018x};")
        print(f"    const {qtype.name}_BLOCK0: &str = \"\\")
        for i in range(0, len(hexes), 88):
            print(f"        {hexes[i:i + 88]}\\")
        print("    \";")


if __name__ == "__main__":
    main()
