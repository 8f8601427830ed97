#!/bin/sh
# From the repository root on the GPU machine (gpubin/ as in ../phi3-parity/command.sh), two
# commands on one machine.
set -e
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln && mkdir -p $OUT
(time /tmp/kiln selftest --only kernels --match attention_forward_gqa,attention_backward_gqa) > $OUT/selftest.log 2>&1
(time python3 bench/phi3_parity.py --kiln /tmp/kiln --tokenizer gpubin/tok --work /tmp/phi3 --only-training) > $OUT/train.log 2>&1
# second command
(time /tmp/kiln bench kernels --only compute --dtypes bf16,f16 --seq 1024 --rows 8192 --channels 3072 --heads 32 --out $OUT/hs96-t1024) > $OUT/bench.log 2>&1
# third command
(time /tmp/kiln selftest --only kernels --match attention_forward_gqa) > $OUT/selftest-prefill.log 2>&1
