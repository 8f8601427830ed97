#!/usr/bin/env bash
# The TMA-fed Hopper attention (the engine's default on sm_90) against the cp.async forms:
#   1. the harness with TMA=1, the engine's four configurations and their `_tma` forms only:
#      checks against the CPU, bit for bit against the engine's configuration, times beside SDPA;
#   2. KILN's attention kernel checks with KILN_ATTENTION_TMA=1 (the engine's TMA path);
#   3. `KILN bench kernels` attention timings at head sizes 64 and 128, T 4096, with
#      KILN_ATTENTION_TMA=0 (cp.async) and 1, alternating twice (one binary).
#   OUT=/tmp/tma-ab bash bench/wgmma_attention/tma_ab.sh KILN
set -u
KILN=${1:?usage: $0 KILN}
out=${OUT:-/tmp/tma-ab}
mkdir -p "$out"
s=$(date +%s)
only=wg_bf16_hs64_n64,wg_f16_hs64_n64,wg_bf16_hs128_n64,wg_f16_hs128_n64
only=$only,wg_bf16_hs64_n64_tma,wg_f16_hs64_n64_tma,wg_bf16_hs128_n64_tma,wg_f16_hs128_n64_tma
TMA=1 HARNESS_ONLY=$only OUT="$out" bash "$(dirname "$0")/run.sh" > "$out/harness.log" 2>&1
echo "harness rc $? t=$(( $(date +%s) - s ))"
grep -E "worst vs cpu|checks:|WARNING|FAIL|DIFFERS" "$out/harness.log" | head -10
grep -E "_tma " "$out/harness.txt" | grep -cE "= n64 g1" | sed 's/^/tma results equal to the engine configuration (lines): /'
cat "$out/summary.txt" 2>/dev/null
KILN_ATTENTION_TMA=1 timeout 300 "$KILN" selftest --only kernels --match attention > "$out/selftest-tma.log" 2>&1
echo "selftest (TMA) rc $? t=$(( $(date +%s) - s ))"
grep -E "checks,|FAIL" "$out/selftest-tma.log" | head -10
for round in 1 2; do
    for tma in 0 1; do
        for shape in "--channels 768 --heads 12" "--channels 2048 --heads 16"; do
            tag=tma$tma-r$round-c$(echo "$shape" | awk '{print $2}')
            # shellcheck disable=SC2086
            KILN_ATTENTION_TMA=$tma timeout 300 "$KILN" bench kernels --only compute --dtypes bf16,f16 \
                --seq 4096 --rows 16384 $shape --no-python --out "$out/$tag" > "$out/$tag.log" 2>&1
            echo "$tag rc $? t=$(( $(date +%s) - s ))"
            grep -E "^attention_forward " "$out/$tag.log" | head -2
        done
    done
done
rm -f "$out"/*/*.png
