#!/bin/bash
# One H200, from the repository root: bench/gemm_candidates/probe.cu built with nvcc and run.
# The run reached the 600-second limit during the enumeration of the 1B shape's fifth product,
# so probe.txt has 20 of the 30 products and no totals.
bash bench/gemm_candidates/run.sh 2>&1 | tee $OUT/probe.txt
