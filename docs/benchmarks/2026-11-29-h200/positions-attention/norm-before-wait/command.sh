#!/usr/bin/env bash
# The appending prologue's row norm factor before its wait (norm) against 5931503 (pref):
# kernel caches filled, `kiln bench generate --no-python` alternating, two rounds; then the
# kernel selftest and fp32 greedy parity with transformers of norm.
set -u
R=$OUT
for b in pref norm; do xz -dc gpubin/kiln-$b.xz > /tmp/kiln-$b && chmod +x /tmp/kiln-$b; done
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,8,16,32,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh pref=/tmp/kiln-pref norm=/tmp/kiln-norm > $R/ab.txt 2>&1
tail -6 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5
timeout 280 /tmp/kiln-norm selftest --only kernels > $R/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $R/selftest.log | tail -2; grep -E "FAIL" $R/selftest.log | head -20
timeout 100 python3 bench/llama_parity.py --kiln /tmp/kiln-norm --tokenizer gpubin/tok --work /tmp/pl --only smollm2-135m > $R/parity.log 2>&1; echo "parity rc $? t=$(( $(date +%s)-s ))"; grep -E "^\|" $R/parity.log | tail -2; grep -E "rror|Trace" $R/parity.log | head -5
