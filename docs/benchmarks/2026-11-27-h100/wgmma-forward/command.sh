set -u
source gpubin/common.sh
gzip -dc gpubin/kiln-new.gz > bin/kiln-new && chmod +x bin/kiln-new
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
# 1. every kernel against the CPU (the fused decode attention and the Hopper forward included)
timeout 220 bin/kiln-new selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $?"
echo "pass $(grep -c 'PASS$' $OUT/selftest.log) fail $(grep -c 'FAIL' $OUT/selftest.log)"; grep "FAIL" $OUT/selftest.log | head -20
echo "decode_attention checks: $(grep -c '^decode_attention.*PASS$' $OUT/selftest.log) pass"; grep -E "^attention_forward" $OUT/selftest.log | head -12
# 2. tokens: old (append then attention) against new (fused), bf16 and fp32, greedy and sampled
printf '%s\n' '{"prompt": "ROMEO:"}' '{"prompt": "To be, or not"}' '{"prompt": "KING HENRY: Once more"}' > /tmp/p.jsonl
gen() { local b=$1 n=$2; shift 2; timeout 90 bin/$b generate --run gpubin/tl --device cuda --prompts /tmp/p.jsonl --tokens 100 --seed 3 "$@" --out /tmp/$n.jsonl 2> /tmp/$n.err || tail -3 /tmp/$n.err; }
for prec in bf16 fp32; do
  KILN_DECODE_FUSED_ROWS=0 KILN_DECODE_FUSED_ATTENTION=0 gen kiln old_g_$prec --precision $prec --temperature 0
  gen kiln-new new_g_$prec --precision $prec --temperature 0
  KILN_DECODE_FUSED_ROWS=0 KILN_DECODE_FUSED_ATTENTION=0 gen kiln old_s_$prec --precision $prec --temperature 0.9 --top-p 0.9 --num-samples 4 --max-batch 5
  gen kiln-new new_s_$prec --precision $prec --temperature 0.9 --top-p 0.9 --num-samples 4 --max-batch 5
  for k in g s; do cmp -s /tmp/old_${k}_$prec.jsonl /tmp/new_${k}_$prec.jsonl && echo "$prec $k: identical ($(wc -c < /tmp/new_${k}_$prec.jsonl) bytes)" || echo "$prec $k: DIFFERENT"; done
done
tail -1 /tmp/new_s_bf16.err
cp /tmp/new_s_bf16.jsonl $OUT/ 2>/dev/null
# 3. decode speed, before and after in one command
bg() { local b=$1; shift; timeout 150 bin/$b bench generate --no-python --new-tokens 128 "$@" 2>&1 | grep -E "^kiln batch|rror"; }
echo "== before (main: append then attention)"; export KILN_DECODE_FUSED_ROWS=0 KILN_DECODE_FUSED_ATTENTION=0
bg kiln --shape smollm2-135m --batches 1,64,256 --out /tmp/a1; bg kiln --shape llama-3.2-1b --batches 1,64 --out /tmp/a2
unset KILN_DECODE_FUSED_ROWS KILN_DECODE_FUSED_ATTENTION
echo "== after (fused append + attention)"
bg kiln-new --shape smollm2-135m --batches 1,64,256 --out /tmp/b1; bg kiln-new --shape llama-3.2-1b --batches 1,64 --out /tmp/b2
# 4. attention kernels: the mma.sync forward (old binary) and the Hopper forward (new), SDPA beside the new
for hs in 64 128; do
  a=""; [ $hs = 128 ] && a="--channels 2048 --heads 16"
  echo "== head size $hs, old binary"; timeout 120 bin/kiln bench kernels --only compute --rows 8192 --dtypes bf16,f16 --no-python $a 2>&1 | grep "^attention" | head -6
  echo "== head size $hs, new binary with SDPA"; timeout 180 bin/kiln-new bench kernels --only compute --rows 8192 --dtypes bf16,f16 $a > $OUT/kernels-hs$hs.log 2>&1; grep -E "attention.*x$" $OUT/kernels-hs$hs.log
done
