set -u
source gpubin/common.sh
gzip -dc gpubin/kiln-new.gz > bin/kiln-new && chmod +x bin/kiln-new
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
bg() { local b=$1; shift; timeout 150 $b bench generate --no-python --new-tokens 128 "$@" 2>&1 | grep -E "^kiln batch|rror"; }
for round in 1 2; do
echo "== round $round: before (main path)"; export KILN_DECODE_FUSED_ROWS=0 KILN_DECODE_FUSED_ATTENTION=0
( time bg bin/kiln --shape smollm2-135m --batches 1,64,256 --out /tmp/a1 ) 2>&1 | grep -v "^$\|user\|sys"
bg bin/kiln --shape llama-3.2-1b --batches 1,64 --out /tmp/a2
unset KILN_DECODE_FUSED_ROWS KILN_DECODE_FUSED_ATTENTION
echo "== round $round: after (skinny products tuned cold in a graph)"
( time bg bin/kiln-new --shape smollm2-135m --batches 1,64,256 --out /tmp/b1 ) 2>&1 | grep -v "^$\|user\|sys"
bg bin/kiln-new --shape llama-3.2-1b --batches 1,64 --out /tmp/b2
done
cp /tmp/b1/*.md $OUT/ 2>/dev/null
timeout 150 bin/kiln-new selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $?"
echo "pass $(grep -c 'PASS$' $OUT/selftest.log) fail $(grep -c 'FAIL' $OUT/selftest.log)"; grep "FAIL" $OUT/selftest.log | head
