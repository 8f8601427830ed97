#!/usr/bin/env bash
# Every kernel of a few decode steps under Nsight Compute, with each kernel's warp-stall
# reasons, then one decode step's kernels by name (bench/decode_profile.py):
#
#   bench/decode_profile.sh KILN [SHAPE] [BATCH] [OUT_DIR]
#
# Defaults: smollm2-135m, batch 64, /tmp/kiln-decode-profile. Caches are not flushed and clocks
# not locked between kernels, as in a replayed decode step; graphs are off so that each kernel
# is its own launch. The stall metrics make Nsight Compute replay each kernel a few times:
# about two minutes for SmolLM2-135M. LAUNCH_SKIP (default 900) and LAUNCH_COUNT (480) pick
# the launches: past the prefill and the first decode steps, at least two whole steps (a
# SmolLM2-135M step is about 160 kernels; a deeper model needs larger values).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 KILN [SHAPE] [BATCH] [OUT_DIR]" >&2; exit 2; }
KILN=$1
SHAPE=${2:-smollm2-135m}
BATCH=${3:-64}
O=${4:-/tmp/kiln-decode-profile}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
mkdir -p "$O"
"$NCU" --cache-control none --clock-control none --csv \
  --metrics "gpu__time_duration.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active" \
  --launch-skip "${LAUNCH_SKIP:-900}" --launch-count "${LAUNCH_COUNT:-480}" \
  "$KILN" bench generate --shape "$SHAPE" --batches "$BATCH" --new-tokens 24 --no-python \
  --no-cuda-graphs --out "$O/bench" > "$O/ncu.csv" 2> "$O/ncu.err" || {
  echo "$0: ncu failed (rc $?); its messages:" >&2; tail -5 "$O/ncu.err" >&2; exit 1; }
python3 "$(dirname "$0")/decode_profile.py" "$O/ncu.csv" | tee "$O/decode_step.txt"
