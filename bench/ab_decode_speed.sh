#!/usr/bin/env bash
# kiln builds side by side on one GPU: `kiln bench generate --no-python` (128 new tokens) by
# each in turn, ROUNDS times, alternating (every other round in reverse order) so that clock and
# thermal drift fall on all of them. Each build first fills its kernel cache, all at once: a
# fresh machine's first start compiles for about a minute, which would otherwise eat a timed
# run's limit. Prints one line per run with the decode new tokens/s of each batch, then each
# build's mean over the rounds and its ratio to the first build's; the logs stay in OUT.
#
#   OUT=/tmp/ab SHAPES=smollm2-135m,llama-3.2-1b BATCHES=1,8,16,32,64 ROUNDS=2 \
#     bench/ab_decode_speed.sh base=OLD_KILN new=NEW_KILN
#
# Before taking builds to a GPU, `cargo test --release --lib every_program_compiles_with_nvrtc`
# compiles every kernel program for sm_80 and sm_90 on any machine with NVRTC: a program that
# does not compile keeps the CUDA backend from starting (this script then stops).
# On the GPU, `kiln selftest --only kernels --match sample_rows` (say) checks just the changed
# kernels against the CPU, without the whole table's minutes.
#
# A build may be a two-line wrapper script that sets a switch and execs a binary, to compare
# one binary with and without it (the wrappers share the binary's kernel cache):
#   printf '#!/bin/sh\nKILN_DECODE_ATTENTION=lanes exec /tmp/kiln "$@"\n' > /tmp/kiln-lanes
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 NAME=KILN [NAME=KILN ...]" >&2; exit 2; }
O=${OUT:-/tmp/kiln-ab-decode}
ROUNDS=${ROUNDS:-2}
SHAPES=${SHAPES:-smollm2-135m,llama-3.2-1b}
BATCHES=${BATCHES:-1,8,16,32,64}
LIMIT=${LIMIT:-60}  # seconds a timed run may take once the caches are filled
mkdir -p "$O"
names=()
bins=()
for a in "$@"; do
  case $a in
    *=*) names+=("${a%%=*}"); bins+=("${a#*=}") ;;
    *) echo "$0: '$a' is not NAME=KILN" >&2; exit 2 ;;
  esac
done
start=$(date +%s)
: >"$O/rates.txt"
for i in "${!names[@]}"; do
  (
    timeout 300 "${bins[$i]}" bench generate --shape smollm2-135m --batches 1 --new-tokens 8 \
      --no-python --out "$O/warm-${names[$i]}" >"$O/warm-${names[$i]}.log" 2>&1
    echo "${names[$i]}: kernel cache filled, rc $? at $(($(date +%s) - start)) s"
  ) &
done
wait
# A build whose CUDA backend does not start (a kernel program that fails to compile, say) runs
# on the CPU under the default `--device auto`: its timed runs would only eat the limit.
for i in "${!names[@]}"; do
  if grep -q "no usable GPU" "$O/warm-${names[$i]}.log"; then
    echo "${names[$i]}: no usable GPU, stopping:" >&2
    grep "no usable GPU" "$O/warm-${names[$i]}.log" | head -3 >&2
    exit 1
  fi
done
order=("${!names[@]}")
for r in $(seq 1 "$ROUNDS"); do
  for shape in ${SHAPES//,/ }; do
    for i in "${order[@]}"; do
      n=${names[$i]}
      log="$O/$n-$shape-r$r.log"
      timeout "$LIMIT" "${bins[$i]}" bench generate --shape "$shape" --batches "$BATCHES" \
        --new-tokens 128 --no-python --out "$O/$n-$shape-r$r" >"$log" 2>&1
      rc=$?
      rates=$(sed -nE 's/^kiln batch ([0-9]+):.*decode ([0-9]+) tok\/s.*/b\1=\2/p' "$log" | tr '\n' ' ')
      echo "$n $shape r$r rc $rc at $(($(date +%s) - start)) s: $rates"
      echo "$n $shape $rates" >>"$O/rates.txt"
    done
  done
  # The next round in the other order.
  rev=()
  for ((j = ${#order[@]} - 1; j >= 0; j--)); do rev+=("${order[$j]}"); done
  order=("${rev[@]}")
done
# Each build's mean over the rounds, and its ratio to the first build's, by shape and batch.
echo "means of $ROUNDS rounds (ratio to ${names[0]}):"
awk -v first="${names[0]}" '
  { for (i = 3; i <= NF; i++) { split($i, kv, "="); key = $2 " " kv[1]; sum[$1, key] += kv[2]; cnt[$1, key]++;
      if (!(key in seen)) { seen[key] = 1; keys[++nk] = key } }
    if (!($1 in known)) { known[$1] = 1; builds[++nb] = $1 } }
  END { for (k = 1; k <= nk; k++) { key = keys[k]; line = key ":";
          base = cnt[first, key] ? sum[first, key] / cnt[first, key] : 0;
          for (b = 1; b <= nb; b++) { n = builds[b]; if (!cnt[n, key]) continue; m = sum[n, key] / cnt[n, key];
            line = line sprintf("  %s %.0f", n, m); if (base > 0 && n != first) line = line sprintf(" (%.3f)", m / base) }
          print line } }' "$O/rates.txt"
