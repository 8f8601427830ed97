#!/usr/bin/env bash
# `kiln selftest --match`: the sampler's and the cache attention's checks alone, timed, and a
# pattern no check matches.
set -u
R=$OUT
xz -dc gpubin/kiln-match.xz > /tmp/kiln-match && chmod +x /tmp/kiln-match
s=$(date +%s)
timeout 240 /tmp/kiln-match selftest --only kernels --match sample_rows,cache_attention > $R/selftest-match.log 2>&1; echo "selftest rc $? t=$(( $(date +%s)-s ))"
grep -E "start|checks|groups|matching" $R/selftest-match.log | head; grep -E "FAIL" $R/selftest-match.log | head -5
timeout 60 /tmp/kiln-match selftest --match no_such_kernel > $R/selftest-nomatch.log 2>&1; echo "no match rc $? t=$(( $(date +%s)-s ))"; tail -2 $R/selftest-nomatch.log
