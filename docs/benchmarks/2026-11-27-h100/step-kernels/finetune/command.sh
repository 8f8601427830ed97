set -u
mkdir -p bin && cp target/release/kiln bin/kiln   # the release build of the commit measured (the same binary as ../); OUT is the log folder
s=$(date +%s)
timeout 230 bin/kiln bench finetune --out /tmp/ft135 > $OUT/ft135.log 2>&1; echo "ft135 rc $? t=$(( $(date +%s)-s ))"; grep -E "tokens/s|target" $OUT/ft135.log | tail -7
timeout 300 bin/kiln bench finetune --shape llama-3.2-1b --out /tmp/ft1b > $OUT/ft1b.log 2>&1; echo "ft1b rc $? t=$(( $(date +%s)-s ))"; grep -E "tokens/s|target" $OUT/ft1b.log | tail -7
cp /tmp/ft135/report.md $OUT/ft135-report.md; cp /tmp/ft1b/report.md $OUT/ft1b-report.md
