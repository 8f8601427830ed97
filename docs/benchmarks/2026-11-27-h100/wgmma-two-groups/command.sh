set -u
mkdir -p bin && gzip -dc gpubin/kiln-new.gz > bin/kiln-new && gzip -dc gpubin/kiln-head.gz > bin/kiln-head && chmod +x bin/kiln-new bin/kiln-head
s=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 200 bash bench/wgmma_attention/run.sh > $OUT/run.txt 2>&1; echo "harness rc $? t=$(( $(date +%s)-s ))"
grep -iE "DIFFERS|FAIL|exceed|spill|C7520" $OUT/run.txt | head -20
tail -45 $OUT/run.txt
timeout 220 bin/kiln-new selftest --only kernels > $OUT/selftest.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
echo "pass $(grep -c 'PASS$' $OUT/selftest.log) fail $(grep -c 'FAIL' $OUT/selftest.log)"; grep "FAIL" $OUT/selftest.log | head; grep "^attention_forward" $OUT/selftest.log | grep -E "C128|hs128|H2 C256" | head
a="--channels 2048 --heads 16"
echo "== head size 128, committed build"; timeout 120 bin/kiln-head bench kernels --only compute --rows 8192 --dtypes bf16,f16 --no-python $a 2>&1 | grep "^attention_forward "
echo "== head size 128, new build with SDPA"; timeout 180 bin/kiln-new bench kernels --only compute --rows 8192 --dtypes bf16,f16 $a > $OUT/kernels-hs128.log 2>&1; grep -E "attention.*x$" $OUT/kernels-hs128.log
echo "t=$(( $(date +%s)-s ))"
