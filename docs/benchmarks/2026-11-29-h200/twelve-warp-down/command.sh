#!/usr/bin/env bash
# 12-warp down product at batch 64 (b) and b plus three chunks a warp in the batch-64 gate/up
# (c, gate-up-three-chunks.diff) against c82b8a5 (head2): kernel caches filled in parallel, then
# `kiln bench generate --no-python` alternating, two rounds; head2 beside transformers; the
# kernel selftest of c. Run from the repository root with the builds under gpubin/.
set -u
for n in head2 b c; do xz -dc gpubin/kiln-$n.xz > /tmp/kiln-$n && chmod +x /tmp/kiln-$n; done
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=16,32,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh head2=/tmp/kiln-head2 b=/tmp/kiln-b c=/tmp/kiln-c
s=$(date +%s)
for sh in smollm2-135m:1,8,16,32,64 llama-3.2-1b:1,8,64; do
  name=${sh%%:*}; b=${sh##*:}
  timeout 150 /tmp/kiln-head2 bench generate --shape $name --batches $b --new-tokens 128 --out /tmp/bg-$name > /tmp/$name.log 2>&1
  echo "$name rc $? t=$(( $(date +%s)-s ))"; grep -E "^(kiln|transformers) batch" /tmp/$name.log
  mkdir -p $OUT/$name; cp /tmp/bg-$name/report.md /tmp/bg-$name/results.json $OUT/$name/ 2>/dev/null
done
timeout 250 /tmp/kiln-c selftest --only kernels > /tmp/st.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "few_rows" /tmp/st.log | grep -vE "PASS" | head; grep -cE "few_rows.*PASS" /tmp/st.log
tail -1 /tmp/st.log
cp /tmp/st.log $OUT/selftest.log
