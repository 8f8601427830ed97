#!/usr/bin/env bash
# The sampler's value bins: 256 of T/64 down to 4 T, then T/8 (b480) against 5931503 (pref):
# kernel caches filled, `kiln bench generate --no-python` alternating, two rounds (SmolLM2-135M
# at batches 1-64, Llama-3.2-1B at 1 and 64); the kernel selftest of b480; the four stages of a
# SmolLM2-135M batch-64 step of each build under Nsight Compute.
set -u
R=$OUT
for b in pref b480; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,8,16,32,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh pref=/tmp/kiln-pref b480=/tmp/kiln-b480 > $R/ab.txt 2>&1
tail -6 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5
OUT=/tmp/ab2 SHAPES=llama-3.2-1b BATCHES=1,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh pref=/tmp/kiln-pref b480=/tmp/kiln-b480 > $R/ab-llama.txt 2>&1
tail -3 $R/ab-llama.txt; echo "t=$(( $(date +%s)-s ))"
for b in pref b480; do
timeout 60 /usr/local/cuda/bin/ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum,smsp__inst_executed.sum -k regex:sample_ --launch-skip 12 --launch-count 4 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 64 --new-tokens 8 --no-python --no-cuda-graphs --out /tmp/bgd > $R/ncu-$b.txt 2>&1; echo "ncu $b rc $?"
grep -E "^  sample_|duration" $R/ncu-$b.txt | paste - - | awk '{print $1, $(NF)}'
done
timeout 280 /tmp/kiln-b480 selftest --only kernels > $R/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $R/selftest.log | tail -2; grep -E "FAIL" $R/selftest.log | head -20; grep -E "sample_rows.*flatter" $R/selftest.log | head -4
