#!/usr/bin/env bash
# The kernel selftest and fp32 greedy parity with transformers of the build with the appending
# decode attention a position a thread.
set -u
R=$OUT
[ -x /tmp/kiln ] || { xz -dc gpubin/kiln-pos2.xz > /tmp/kiln && chmod +x /tmp/kiln; }
s=$(date +%s)
timeout 280 /tmp/kiln selftest --only kernels > $R/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $R/selftest.log | tail -2; grep -E "FAIL" $R/selftest.log | head -20
grep -E "cache_attention_append" $R/selftest.log | head -40
timeout 100 python3 bench/llama_parity.py --kiln /tmp/kiln --tokenizer gpubin/tok --work /tmp/pl --only smollm2-135m > $R/parity.log 2>&1; echo "parity rc $? t=$(( $(date +%s)-s ))"; grep -E "^\|" $R/parity.log | tail -4; grep -E "rror|Trace" $R/parity.log | head -5
