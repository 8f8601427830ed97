#!/usr/bin/env bash
# NF4 weights on the GPU, in one command from the repository root:
#   1. `kiln selftest --only nf4`: the CUDA dequantisation against the CPU reference, bit for
#      bit, in f32, bf16 and f16 at four shapes (NaN-poisoned outputs);
#   2. `kiln bench kernels --only nf4`: dequantisation GB/s for a 2048x8192 and an 8192x2048
#      weight beside the bf16 GEMM it feeds at 8192 tokens, and the share of the GEMM's time
#      it costs; PyTorch (bitsandbytes' dequantize_4bit when it imports) in the same command;
#   3. when bitsandbytes imports: kiln's quantisation of random weights against
#      bitsandbytes' quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=True),
#      code for code (through the hidden `kiln nf4-export`), and the dequantised values.
#
#   KILN=target/release/kiln OUT=/some/dir bench/nf4_gpu_check.sh
# bitsandbytes is not on the GPU machines: `pip download --no-deps bitsandbytes` here, put the
# wheel in .cache/wheels/ and carry it; the script installs it into $OUT (no network needed).
# Prints PASS/FAIL lines and the numbers; exits 1 if any check failed. Logs go under $OUT
# (a temporary directory when unset).
set -uo pipefail
KILN=${KILN:-target/release/kiln}
LOG=${OUT:-$(mktemp -d)}/nf4
mkdir -p "$LOG"
failed=0
report() { # report NAME STATUS DETAIL
  if [ "$2" = 0 ]; then echo "PASS $1 $3"; else echo "FAIL $1 $3"; failed=1; fi
}
[ -x "$KILN" ] || { echo "FAIL $KILN is not an executable kiln binary (set KILN)"; exit 1; }

if ! python3 -c "import bitsandbytes" 2>/dev/null; then
  wheel=$(ls .cache/wheels/bitsandbytes-*.whl 2>/dev/null | head -n 1)
  if [ -n "$wheel" ] && python3 -m pip install --quiet --no-deps --no-index \
      --target "$LOG/pylib" "$wheel" >"$LOG/pip.txt" 2>&1; then
    export PYTHONPATH="$LOG/pylib${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi

echo "== 1. CUDA dequantisation against the CPU reference (kiln selftest --only nf4)"
timeout 150 "$KILN" selftest --only nf4 >"$LOG/selftest.txt" 2>&1
rc=$?
grep -E "^(device|nf4)" "$LOG/selftest.txt"
grep -q "^selftest skipped" "$LOG/selftest.txt" && rc=1
report "selftest-nf4" $rc "($(grep -c '^nf4.*PASS$' "$LOG/selftest.txt") checks passed, $(grep -c '^nf4.*FAIL$' "$LOG/selftest.txt") failed; log $LOG/selftest.txt)"

echo "== 2. dequantisation beside the bf16 GEMM it feeds (kiln bench kernels --only nf4)"
timeout 150 "$KILN" bench kernels --only nf4 --out "$LOG/bench" >"$LOG/bench.txt" 2>&1
rc=$?
grep -E "^(ceilings|nf4_dequantize|linear_forward nf4|NF4 )" "$LOG/bench.txt"
python3 - "$LOG/bench/results.json" <<'PY' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
rows = [x for x in r["rows"] if x["group"] == "nf4"]
print(f"{'kernel':<30} {'kiln us':>9} {'rate':>14} {'PyTorch us':>11}  PyTorch op")
for x in rows:
    rate = f"{x['achieved']:.0f} {x['achieved_unit']}"
    py = f"{x['pytorch_ms'] * 1e3:.1f}" if x.get("pytorch_ms") else "-"
    print(f"{x['kernel']:<30} {x['ms'] * 1e3:>9.1f} {rate:>14} {py:>11}  {x.get('pytorch_op') or ''}")
sys.exit(0 if len(rows) == 4 else 1)
PY
report "bench-nf4" $rc "(report $LOG/bench/report.md)"

echo "== 3. kiln's quantisation against bitsandbytes"
python3 - "$KILN" "$LOG" <<'PY'
import subprocess, sys
kiln, log = sys.argv[1], sys.argv[2]
try:
    import numpy as np
    import torch
    import bitsandbytes.functional as F
    assert torch.cuda.is_available(), "torch sees no GPU"
except Exception as e:
    print(f"SKIP bitsandbytes comparison: {type(e).__name__}: {e}")
    sys.exit(0)
failed = False
torch.manual_seed(0)
# Llama-3.2-1B's down projection (257 groups of 256 absmax codes), SmolLM2's MLP, and an odd
# value count (the last block padded, the last byte half padding).
for rows, cols in ((2048, 8192), (576, 1536), (37, 91)):
    n = rows * cols
    w = torch.randn(rows, cols) * 0.02
    src, out = f"{log}/w_{rows}x{cols}.f32", f"{log}/kiln_{rows}x{cols}"
    w.numpy().astype("<f4").tofile(src)
    subprocess.run([kiln, "nf4-export", "--input", src, "--rows", str(rows), "--cols", str(cols),
                    "--out", out], check=True, capture_output=True)
    load = lambda name, dt: np.fromfile(f"{out}/{name}", dtype=dt)
    q, st = F.quantize_4bit(w.cuda(), blocksize=64, compress_statistics=True, quant_type="nf4")
    nbytes = (n + 1) // 2
    packed_diff = int((load("packed.u8", np.uint8)[:nbytes] != q.cpu().numpy().reshape(-1)[:nbytes]).sum())
    kc, bc = load("absmax_codes.u8", np.uint8).astype(int), st.absmax.cpu().numpy().astype(int)
    code_diff = int((kc != bc).sum())
    far_codes = int((abs(kc - bc) > 1).sum())
    koff, boff = float(load("offset.f32", np.float32)[0]), float(st.offset)
    ks, bs = load("absmax_scales.f32", np.float32), st.state2.absmax.float().cpu().numpy()
    kmap, bmap = load("dynamic_map.f32", np.float32), st.state2.code.float().cpu().numpy()
    map_ulps = int(abs(kmap.view(np.int32).astype(np.int64) - bmap.view(np.int32).astype(np.int64)).max())
    nf4_same = bool((load("nf4_code.f32", np.float32) == st.code.float().cpu().numpy()).all())
    kd = load("dequantized.f32", np.float32)
    bd = F.dequantize_4bit(q, st).float().cpu().numpy().reshape(-1)
    deq_same = int((kd.view(np.int32) == bd.view(np.int32)).sum())
    deq_err = float(abs(kd - bd).max() / abs(bd).max())
    off_err = abs(koff - boff) / abs(boff)
    scale_err = float(abs(ks - bs).max() / abs(bs).max())
    # The 4-bit codes depend only on each block's absmax: equal. The offset is a mean (f64 in
    # kiln, PyTorch's f32 reduction in bitsandbytes): within a few f32 ulps, and an absmax code
    # on a midpoint may then move to its neighbour.
    ok = (packed_diff == 0 and nf4_same and off_err <= 1e-6 and scale_err <= 1e-6
          and far_codes == 0 and code_diff <= max(1, len(bc) // 1000) and deq_err <= 1e-2)
    failed |= not ok
    print(f"{'PASS' if ok else 'FAIL'} bnb-{rows}x{cols}: packed bytes differing {packed_diff} of {nbytes}; "
          f"absmax codes differing {code_diff} of {len(bc)} ({far_codes} by more than one); "
          f"offset {koff:.9g} vs {boff:.9g} (rel {off_err:.1e}); scales rel {scale_err:.1e}; "
          f"dynamic map max {map_ulps} ulp apart; NF4 values equal {nf4_same}; "
          f"dequantised bit-identical {deq_same} of {n}, max diff {deq_err:.1e} of the largest")
sys.exit(1 if failed else 0)
PY
rc=$?
[ $rc = 0 ] || { echo "FAIL bnb-comparison (see above)"; failed=1; }

if [ $failed = 0 ]; then echo "nf4 GPU check: PASS"; else echo "nf4 GPU check: FAIL"; fi
exit $failed
