#!/usr/bin/env bash
# The sampler's fine value bins and one-exponential maximum pass (bins) against 5931503
# (pref): kernel caches filled, `kiln bench generate --no-python` alternating, two rounds; then
# the kernel selftest and fp32 greedy parity with transformers of bins; then the four stages of
# a batch-64 step of bins under Nsight Compute.
set -u
R=$OUT
for b in pref bins; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,8,16,32,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh pref=/tmp/kiln-pref bins=/tmp/kiln-bins > $R/ab.txt 2>&1
tail -6 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5
timeout 300 /tmp/kiln-bins selftest --only kernels > $R/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $R/selftest.log | tail -2; grep -E "FAIL" $R/selftest.log | head -20; grep -E "sample_rows" $R/selftest.log | head -3
timeout 100 python3 bench/llama_parity.py --kiln /tmp/kiln-bins --tokenizer gpubin/tok --work /tmp/pl --only smollm2-135m > $R/parity.log 2>&1; echo "parity rc $? t=$(( $(date +%s)-s ))"; grep -E "^\|" $R/parity.log | tail -2; grep -E "rror|Trace" $R/parity.log | head -5
timeout 100 /usr/local/cuda/bin/ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum,smsp__inst_executed.sum -k regex:sample_ --launch-skip 12 --launch-count 8 /tmp/kiln-bins bench generate --shape smollm2-135m --batches 64 --new-tokens 8 --no-python --no-cuda-graphs --out /tmp/bgd > $R/ncu.txt 2>&1; echo "ncu rc $? t=$(( $(date +%s)-s ))"
grep -E "sample_|duration|inst_executed" $R/ncu.txt | head -40
