#!/bin/bash
# The harness at each step of the table in docs/perf-log.md ("A product of kiln's own with the
# GELU in its epilogue"), one H200; the committed bench/wgmma_gemm is the last step's. The
# first form's kernels are first-form-128x128.cuh (put in place of gemm.cuh to rebuild it).
OUT=$OUT bash bench/wgmma_gemm/run.sh                     # 1-4: harness.txt, ptxas.txt
OUT=$OUT bash bench/wgmma_gemm/ncu.sh 'gemm_tn_plain_s4'  # ncu-*.txt, cuBLASLt's kernel beside it
