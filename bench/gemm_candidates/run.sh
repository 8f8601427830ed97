#!/bin/bash
# Builds and runs probe.cu on a Hopper GPU (see its header): bash bench/gemm_candidates/run.sh
set -o pipefail
nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/gemm_candidates "$(dirname "$0")/probe.cu" -lcublasLt || exit 1
/tmp/gemm_candidates
