#!/usr/bin/env python3
"""Where a kiln kernel's instructions go, on a machine without a GPU.

Compiles one of the engine's NVRTC programs as the engine composes it (common.cuh, then the
parts of its `Program { name, source }` in src/engine/cuda/*.rs), with the engine's options,
through the libnvrtc that .ci/run fetches, and prints each basic block of one kernel's PTX
that holds at least --min instructions: its instruction count and its most frequent opcodes
(a predicated instruction counts under its opcode). The blocks of a hot loop stand out by
their mma/wgmma and ex2 counts; predicate and select instructions beside them are work the
loop does on every iteration. With --arch sm_XX (or sm_90a) it also prints ptxas's registers
and spills for the kernel, and with --cubin FILE writes the program's cubin for nvdisasm (the
PyPI wheel nvidia-cuda-nvdisasm has one) to read the kernel's SASS.

  LD_LIBRARY_PATH=.ci/nvrtc/nvidia/cu13/lib python3 bench/ptx_blocks.py attention_tc \\
      attention_backward_dkv_bf16_hs64_wgmma --arch compute_90a
"""
import argparse
import collections
import ctypes
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = os.path.join(ROOT, "src", "engine", "cuda")
OPTIONS = ["--std=c++17"]  # nvrtc.rs's OPTIONS


def literal(text, i):
    """The Rust string literal starting at text[i] (a quote) and the index after it."""
    out, i = [], i + 1
    escapes = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "0": "\0"}
    while text[i] != '"':
        if text[i] == "\\":
            out.append(escapes[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out), i + 1


def program_source(name):
    """common.cuh and the parts of the program called `name`, joined as the engine joins them."""
    pattern = re.compile(r'name:\s*"' + re.escape(name) + r'",\s*source:\s*')
    for path in sorted(glob.glob(os.path.join(CUDA, "*.rs"))):
        text = open(path).read()
        m = pattern.search(text)
        if not m:
            continue
        i, parts, depth = m.end(), [], 0
        if text.startswith("concat!(", i):
            i += len("concat!(")
            depth = 1
        while True:
            if text.startswith("include_str!(", i):
                file, i = literal(text, i + len("include_str!("))
                parts.append(open(os.path.join(CUDA, file)).read())
                i += 1  # its closing parenthesis
            elif text[i] == '"':
                s, i = literal(text, i)
                parts.append(s)
            elif text[i] == ")" and depth:
                break
            elif text[i] == "," and not depth:
                break
            else:
                i += 1
        common = open(os.path.join(CUDA, "common.cuh")).read()
        return common + "\n" + "".join(parts)
    sys.exit(f"no program named {name!r} in {CUDA}/*.rs")


def compile_program(source, arch, verbose, cubin=None):
    lib = ctypes.CDLL("libnvrtc.so.13")
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"program.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = OPTIONS + ["--gpu-architecture=" + arch] + (["-Xptxas=-v"] if verbose else [])
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(log.value.decode())
    if arch.startswith("compute_"):
        lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
        ptx = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode(), log.value.decode()
    if cubin:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        image = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, image)
        with open(cubin, "wb") as f:
            f.write(image.raw)
    return None, log.value.decode()


def blocks(ptx, kernel):
    lines = ptx.split("\n")
    head = f".entry {kernel}("
    start = next((i for i, l in enumerate(lines) if head in l), None)
    if start is None:
        names = [l.split(".entry ")[1].split("(")[0] for l in lines if ".entry " in l]
        sys.exit(f"no kernel {kernel!r}; the program has: {', '.join(names)}")
    end = next((i for i in range(start + 1, len(lines)) if ".entry " in lines[i]), len(lines))
    out, name, body = [], "entry", []
    for line in lines[start:end]:
        s = line.strip()
        label = re.match(r"^(\$\w+):", s)
        if label:
            out.append((name, body))
            name, body = label.group(1), []
        elif s and not s.startswith(("//", ".", "{", "}", ")")):
            body.append(re.sub(r"^@!?%p\d+\s+", "", s))
    out.append((name, body))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("program", help="a Program name, e.g. attention_tc, rmsnorm, sampling")
    ap.add_argument("kernel", help="an entry point of that program")
    ap.add_argument("--arch", default="compute_90a",
                    help="compute_XX for the PTX blocks, sm_XX for ptxas's registers and spills")
    ap.add_argument("--cubin", metavar="FILE",
                    help="with --arch sm_XX, also write the program's cubin to FILE (for nvdisasm)")
    ap.add_argument("--min", type=int, default=40, help="the fewest instructions a block shown has")
    a = ap.parse_args()
    if a.cubin and not a.arch.startswith("sm_"):
        ap.error("--cubin needs --arch sm_XX (a cubin is compiled for one GPU), e.g. --arch sm_90a")
    source = program_source(a.program)
    if a.arch.startswith("sm_"):
        _, log = compile_program(source, a.arch, True, a.cubin)
        lines = log.splitlines()
        for i, l in enumerate(lines):
            if "Compiling entry" in l and f"'{a.kernel}'" in l:
                print("\n".join(x.strip() for x in lines[i:i + 4]))
        return
    ptx, _ = compile_program(source, a.arch, False)
    total = 0
    for name, body in blocks(ptx, a.kernel):
        total += len(body)
        if len(body) < a.min:
            continue
        ops = collections.Counter(re.split(r"[\s;]", i)[0] for i in body)
        print(f"{name:14s} {len(body):5d}  " + " ".join(f"{k}:{v}" for k, v in ops.most_common(12)))
    print(f"{a.kernel}: {total} PTX instructions in all (static)")


if __name__ == "__main__":
    main()
