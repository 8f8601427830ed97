#!/usr/bin/env bash
# The final build (appending kernel only for wide calls, two kernels otherwise): kernel
# selftest, then `kiln bench generate --no-python` on both shapes.
set -u
gunzip -c gpubin/kiln-fuse.gz > /tmp/kiln-fuse; chmod +x /tmp/kiln-fuse
s=$(date +%s)
timeout 245 /tmp/kiln-fuse selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks|passed|failed" $OUT/selftest.log | tail -3; grep -E "FAIL" $OUT/selftest.log | head
grep -E "^cache_attention_append" $OUT/selftest.log | sort -k5 -g -t'|' | tail -3
for sh in smollm2-135m llama-3.2-1b; do
  timeout 40 /tmp/kiln-fuse bench generate --shape $sh --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$sh > $OUT/$sh-final.log 2>&1
  echo "$sh rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" $OUT/$sh-final.log
done
