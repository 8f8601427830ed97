#!/usr/bin/env bash
# Where the sampler's time goes: SmolLM2-135M decode at batches 1, 8, 64 with top-p 0.9
# (four stages), top-p 1 (max and draw) and greedy (max only), one binary, alternating, two
# rounds; then the four stages of a batch-64 decode step under Nsight Compute (full set).
set -u
R=$OUT
xz -dc gpubin/kiln-pref.xz > /tmp/kiln && chmod +x /tmp/kiln
printf '#!/bin/sh\nexec /tmp/kiln "$@" --top-p 1\n' > /tmp/kiln-temp; chmod +x /tmp/kiln-temp
printf '#!/bin/sh\nexec /tmp/kiln "$@" --temperature 0\n' > /tmp/kiln-greedy; chmod +x /tmp/kiln-greedy
s=$(date +%s)
OUT=/tmp/ab SHAPES=smollm2-135m BATCHES=1,8,64 ROUNDS=2 LIMIT=60 bash bench/ab_decode_speed.sh topp=/tmp/kiln temp=/tmp/kiln-temp greedy=/tmp/kiln-greedy > $R/ab.txt 2>&1
tail -5 $R/ab.txt; grep -ihE "error|panic" /tmp/ab/*.log | head -5
echo "t=$(( $(date +%s)-s ))"
timeout 200 /usr/local/cuda/bin/ncu --set full --import-source no --cache-control none --clock-control none -k regex:sample_ --launch-skip 12 --launch-count 4 -o /tmp/samp /tmp/kiln bench generate --shape smollm2-135m --batches 64 --new-tokens 8 --no-python --no-cuda-graphs --out /tmp/bgd > /tmp/ncu.log 2>&1; echo "ncu rc $? t=$(( $(date +%s)-s ))"; tail -3 /tmp/ncu.log
/usr/local/cuda/bin/ncu -i /tmp/samp.ncu-rep --page details > $R/details.txt 2>&1
/usr/local/cuda/bin/ncu -i /tmp/samp.ncu-rep --page source --csv --print-source sass > /tmp/src.csv 2>&1; echo "src rc $?"; gzip -c /tmp/src.csv > $R/source.csv.gz; ls -la $R
cp /tmp/samp.ncu-rep $R/ 2>/dev/null
grep -E "sample_|Duration|Registers Per|Achieved Occ|Theoretical Occ|Block Limit" $R/details.txt | head -60
