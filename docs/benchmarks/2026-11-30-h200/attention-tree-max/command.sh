#!/usr/bin/env bash
# The attention score tile's row maximum as a tree (b) against the chain before it (a): the
# harness's engine configurations, checks and times, the two builds alternating twice.
set -u
R=$OUT
s=$(date +%s)
mkdir -p /tmp/A/bench/wgmma_attention /tmp/A/src/engine/cuda
cp src/engine/cuda/*.cu src/engine/cuda/*.cuh /tmp/A/src/engine/cuda/
cp gpubin/head/attention_tc.cu /tmp/A/src/engine/cuda/attention_tc.cu
cp bench/wgmma_attention/harness.cu /tmp/A/bench/wgmma_attention/
F="-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a"
nvcc $F -o /tmp/hA /tmp/A/bench/wgmma_attention/harness.cu > $R/nvcc-a.txt 2>&1 &
nvcc $F -o /tmp/hB bench/wgmma_attention/harness.cu > $R/nvcc-b.txt 2>&1 &
wait; echo "built t=$(( $(date +%s)-s ))"; ls -la /tmp/hA /tmp/hB | cut -c1-80
export HARNESS_ONLY=wg_bf16_hs128_n64,wg_f16_hs128_n64,wg_bf16_hs64_n64,wg_f16_hs64_n64
for r in 1 2; do for b in A B; do
  timeout 60 /tmp/h$b > $R/h$b$r.txt 2>&1; echo "$b$r rc $? t=$(( $(date +%s)-s ))"
  grep -E "^time" $R/h$b$r.txt | awk -v b=$b '{print b, $0}' | cut -c1-110
done; done
grep -E "worst vs cpu|checks" $R/hA1.txt $R/hB1.txt
diff <(grep -E "vs cpu" $R/hA1.txt) <(grep -E "vs cpu" $R/hB1.txt) | head -5; echo "check lines differing: $(diff <(grep -E 'vs cpu' $R/hA1.txt) <(grep -E 'vs cpu' $R/hB1.txt) | grep -c '^<')"
