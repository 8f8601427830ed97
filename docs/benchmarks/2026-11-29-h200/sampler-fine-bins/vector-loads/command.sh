#!/usr/bin/env bash
# The sampler reading runs of 8 ids a thread in one 16-byte load, with stage 1's lean pass
# (vec), against the 480 value bins alone (b480) and 5931503 (pref): kernel caches filled,
# `kiln bench generate --no-python` alternating, two rounds; the kernel selftest and fp32
# greedy parity of vec; the stages of a SmolLM2-135M batch-64 step of vec under Nsight
# Compute; Llama-3.2-1B at batches 1 and 64.
set -u
R=$OUT
for b in pref b480 vec; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,8,16,32,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh pref=/tmp/kiln-pref b480=/tmp/kiln-b480 vec=/tmp/kiln-vec > $R/ab.txt 2>&1
tail -6 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5; echo "t=$(( $(date +%s)-s ))"
timeout 270 /tmp/kiln-vec selftest --only kernels > $R/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $R/selftest.log | tail -2; grep -E "FAIL" $R/selftest.log | head -20
timeout 60 python3 bench/llama_parity.py --kiln /tmp/kiln-vec --tokenizer gpubin/tok --work /tmp/pl --only smollm2-135m > $R/parity.log 2>&1; echo "parity rc $? t=$(( $(date +%s)-s ))"; grep -E "^\|" $R/parity.log | tail -1 | cut -c1-200
timeout 40 /usr/local/cuda/bin/ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum,smsp__inst_executed.sum -k regex:sample_ --launch-skip 12 --launch-count 4 /tmp/kiln-vec bench generate --shape smollm2-135m --batches 64 --new-tokens 8 --no-python --no-cuda-graphs --out /tmp/bgd > $R/ncu-vec.txt 2>&1; echo "ncu rc $?"
grep -E "^  sample_|duration" $R/ncu-vec.txt | paste - - | awk '{print $1, $(NF)}'
OUT=/tmp/ab2 SHAPES=llama-3.2-1b BATCHES=1,64 ROUNDS=2 LIMIT=40 bash bench/ab_decode_speed.sh pref=/tmp/kiln-pref vec=/tmp/kiln-vec > $R/ab-llama.txt 2>&1
tail -3 $R/ab-llama.txt; echo "t=$(( $(date +%s)-s ))"
