#!/bin/bash
# Builds the decode-product harness for sm_90a and runs its checks and timings. From the
# repository root on a Hopper GPU:  bash bench/decode_products/run.sh
set -o pipefail
dir=$(dirname "$0")
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/decode_products \
    "$dir/harness.cu" -lcublasLt 2>/tmp/decode_products_ptxas.txt \
    || { cat /tmp/decode_products_ptxas.txt; exit 1; }
grep -A2 "decode_product_" /tmp/decode_products_ptxas.txt | grep -E "registers|spill" | sort | uniq -c
/tmp/decode_products
