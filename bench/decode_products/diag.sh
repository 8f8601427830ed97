#!/bin/bash
# Times every configuration of the SmolLM2 decode products with each phase of the kernel left
# out in turn (SKIP_NORM, SKIP_MMA, SKIP_REDUCE, then all three), to see where a product's time
# goes. From the repository root on a Hopper GPU:  bash bench/decode_products/diag.sh
# EXTRA=-DDP_PULL times the version whose figures are recorded (partial tiles read remotely).
set -o pipefail
cd bench/decode_products
for v in BASE SKIP_NORM SKIP_MMA SKIP_REDUCE "SKIP_NORM -DSKIP_MMA -DSKIP_REDUCE"; do
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -D$v ${EXTRA:-} -o /tmp/dp_$$ harness.cu -lcublasLt && echo "== $v" && /tmp/dp_$$ sweep | grep -E "empty|sweep"
done
