#!/usr/bin/env bash
# The speed guard, one device call: this tree's key engine rows (llama8b decode b=1 and b=64 and an 8k
# prefill, hybrid8b decode b=1 and b=64; default flags) against the baseline commit's, interleaved in
# the same call (bench/speed_guard.py compare). Exits 1 when a row of this tree is more than 3% slower.
# The baseline is the commit named on bench/RESULTS.md's "Speed guard baseline:" line (the last one
# whose figures are there), packed here first, since the device gets no git history:
#   python bench/speed_guard.py pack $(sed -n 's/^Speed guard baseline: `\([0-9a-f]*\)`.*/\1/p' bench/RESULTS.md)
# then the call, carrying .trees and .whl:
#   OUT=... bash bench/device/speed_guard.sh [baseline] [rounds]
set -u
OUT=${OUT:-/tmp/speed_guard}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
BASELINE=${1:-$(sed -n 's/^Speed guard baseline: `\([0-9a-f]*\)`.*/\1/p' bench/RESULTS.md)}
ROUNDS=${2:-2}
timeout -k 10 540 $PY bench/speed_guard.py compare --baseline "$BASELINE" --rounds "$ROUNDS" --budget-s 330 \
    --out "$OUT" 2>&1 | tee "$OUT/speed_guard.log"
rc=${PIPESTATUS[0]}
cat "$OUT/speed_guard_compare.txt" >> "$SUMMARY" 2>/dev/null || say "speed guard: no table (rc $rc)"
exit $rc
