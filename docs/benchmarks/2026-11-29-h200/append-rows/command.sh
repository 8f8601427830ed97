#!/usr/bin/env bash
# Row-wise cache append (16-byte pieces, operands loaded before the norm factor), SwiGLU's and the
# appending attention's loads ahead of the factor, and a call's cache ids uploaded once:
# kernel selftest of the new build (append), then `kiln bench generate --no-python` with the
# previous build (prefill) and this one alternating twice.
set -u
for b in prefill append; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
timeout 330 /tmp/kiln-append selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "checks in all" $OUT/selftest.log | tail -2; grep -E "FAIL" $OUT/selftest.log | head -20
grep -E "^(kv_append|cache_attention_append|prefill_attention|swiglu)" $OUT/selftest.log | awk -F"|" "{print \$1, \$NF}" | sort | uniq -c; grep -E "rot(32|24)" $OUT/selftest.log
for round in 1 2; do
  for b in prefill append; do
    for sh in smollm2-135m llama-3.2-1b; do
      timeout 45 /tmp/kiln-$b bench generate --shape $sh --batches 1,8,64,256 --new-tokens 128 --no-python --out /tmp/bg-$b-$sh > /tmp/$b-$sh-$round.log 2>&1
      echo "$b $sh round $round rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" /tmp/$b-$sh-$round.log
    done
  done
done
