#!/usr/bin/env bash
# The fused gate/up kernel bounded to three blocks an SM only for calls of more than 16 rows
# (grp: its own entry point) against the build before (pdl2, 29e9f37), both overlapped: kernel
# caches filled in parallel, then `kiln bench generate --no-python`, 128 new tokens, alternating,
# two rounds (SmolLM2-135M batches 1-64; Llama-3.2-1B batches 8 and 16, where the bound cost 4%).
set -u
for b in pdl2 grp; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
s=$(date +%s)
for b in pdl2 grp; do
  (timeout 200 /tmp/kiln-$b bench generate --shape smollm2-135m --batches 1 --new-tokens 8 --no-python --out /tmp/warm-$b > /tmp/warm-$b.log 2>&1; echo "$b warm rc $? t=$(( $(date +%s)-s ))") &
done
wait
run() { # build shape batches round
  timeout 40 /tmp/kiln-$1 bench generate --shape $2 --batches $3 --new-tokens 128 --no-python --out /tmp/bg-$1-$2 > $OUT/$1-$2-r$4.log 2>&1
  echo "$1 $2 r$4 rc $? t=$(( $(date +%s)-s ))"; grep -E "^kiln batch" $OUT/$1-$2-r$4.log | sed 's/prefill.*decode/decode/'; grep -rh "graphs off" /tmp/bg-$1-$2 2>/dev/null | head -2
}
for r in 1 2; do
  for b in pdl2 grp; do run $b smollm2-135m 1,8,16,32,64 $r; run $b llama-3.2-1b 8,16 $r; done
done
