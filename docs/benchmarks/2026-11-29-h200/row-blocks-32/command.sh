#!/usr/bin/env bash
# The 32-row few-row product blocks (x4, change.diff) against c73f4bd (head): kernel caches
# filled in parallel, then `kiln bench generate --no-python` alternating, two rounds; the kernel
# selftest of x4 after. Run from the repository root with the builds under gpubin/.
set -u
for n in head x4; do xz -dc gpubin/kiln-$n.xz > /tmp/kiln-$n && chmod +x /tmp/kiln-$n; done
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,16,32,64 ROUNDS=2 LIMIT=90 bash bench/ab_decode_speed.sh head=/tmp/kiln-head x4=/tmp/kiln-x4
s=$(date +%s)
timeout 330 /tmp/kiln-x4 selftest --only kernels > /tmp/st.log 2>&1; echo "selftest rc $? in $(( $(date +%s)-s )) s"
grep -i "few_rows" /tmp/st.log | head -30
tail -5 /tmp/st.log
cp /tmp/st.log $OUT/selftest.log
