#!/usr/bin/env bash
# Decode steps queued one ahead of the host's reading: old build (each step read before the
# next), new build, new build with --no-overlap, alternating; then the decode GPU check.
set -u
for b in old new; do gunzip -c gpubin/kiln-$b.gz > /tmp/kiln-$b; chmod +x /tmp/kiln-$b; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
s=$(date +%s)
bg() {  # label, binary, shape, batches, extra
  local label=$1 bin=$2 shape=$3 batches=$4; shift 4
  timeout 200 /tmp/kiln-$bin bench generate --shape $shape --batches $batches --new-tokens 128 --no-python \
    --out $OUT/$label "$@" > $OUT/$label.log 2>&1 || echo "$label rc $?"
  python3 -c "
import json; d=json.load(open('$OUT/$label/results.json'))
print('$label', ' '.join(f\"b{p['batch']}={p['decode_tokens_per_s']:.0f}({100*(p.get('floor_fraction') or 0):.0f}%)\" for p in d['points'] if p['engine']=='kiln'))"
  rm -f $OUT/$label/*.png
}
for r in 1 2; do
  bg smol-old-$r old smollm2-135m 1,8,64,256
  bg smol-new-$r new smollm2-135m 1,8,64,256
  bg smol-seq-$r new smollm2-135m 1,8,64,256 --no-overlap
  echo "t=$(( $(date +%s)-s ))"
done
bg l1b-old old llama-3.2-1b 1,64
bg l1b-new new llama-3.2-1b 1,64
bg l1b-seq new llama-3.2-1b 1,64 --no-overlap
echo "t=$(( $(date +%s)-s ))"
SELFTEST=0 KILN=/tmp/kiln-new OUT=$OUT/check timeout 250 bash bench/decode_gpu_check.sh 2>&1 | grep -vE "^  (SmolLM2|Llama|  )" | tail -30
rm -rf $OUT/check/decode/tiny-llama $OUT/check/decode/bench-*/*.png
echo "t=$(( $(date +%s)-s ))"
