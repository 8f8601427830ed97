#!/bin/bash
# One H200, from the repository root: bench/sm_partition/probe.cu built with nvcc and run.
bash bench/sm_partition/run.sh 2>&1 | tee $OUT/probe.txt
