#!/usr/bin/env bash
# 16-warp few-row blocks (w16) against c73f4bd (head): kernel caches filled in parallel, then
# `kiln bench generate --no-python` alternating, two rounds; the kernel selftest of w16 after.
# Run from the repository root with the builds under gpubin/.
set -u
for n in head w16; do xz -dc gpubin/kiln-$n.xz > /tmp/kiln-$n && chmod +x /tmp/kiln-$n; done
OUT=/tmp/ab SHAPES=smollm2-135m,llama-3.2-1b BATCHES=1,8,16,32,64 ROUNDS=2 LIMIT=90 bash bench/ab_decode_speed.sh head=/tmp/kiln-head w16=/tmp/kiln-w16
grep -E "^kiln batch" /tmp/ab/w16-llama-3.2-1b-r1.log | head -6
s=$(date +%s)
timeout 300 /tmp/kiln-w16 selftest --only kernels > /tmp/st.log 2>&1; echo "selftest rc $? in $(( $(date +%s)-s )) s"
grep -E "few_rows" /tmp/st.log | grep -vE "PASS" | head; grep -cE "few_rows.*PASS" /tmp/st.log
tail -2 /tmp/st.log
cp /tmp/st.log $OUT/selftest.log
