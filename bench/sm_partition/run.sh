#!/bin/bash
# Builds and runs probe.cu on the GPU machine (see its header). Run from the repository root:
# bash bench/sm_partition/run.sh
set -o pipefail
dir=$(dirname "$0")
nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/sm_partition "$dir/probe.cu" -lcublasLt || exit 1
/tmp/sm_partition
