#!/usr/bin/env bash
# The ipc transport on one GPU, in one device call:
#   1. bench/micro/ipc_launch.py: the receiver's copy launch, piece by piece (host microseconds), and the
#      fused copy+hash's GPU time;
#   2. bench/micro/ipc_restart.py: a CE keeping a dead PE's KV pool mapped: is its memory held, can a new PE
#      allocate its pool;
#   3. bench/micro/handoff.py --tokens 16384 --repeats 9: the in-place ipc handoff (and --ipc-copy-in, tcp)
#      against the device copy of the same bytes, in the same run;
#   4. tests/transfer/test_transfer_gpu.py.
# Logs under $OUT, a summary last ($OUT/summary.txt). Limits in seconds: LAUNCH_S 90, RESTART_S 120,
# HANDOFF_S 150, TESTS_S 90; SKIP_TESTS=1 leaves step 4 out.
#   OUT=... bash bench/device/ipc_check.sh
set -u
OUT=${OUT:-/tmp/ipc_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
t0=$(date +%s)
timeout -k 5 "${LAUNCH_S:-90}" $PY bench/micro/ipc_launch.py > "$OUT/ipc_launch.txt" 2>&1
say "ipc_launch: rc $? in $(( $(date +%s) - t0 )) s"
grep -E "host|GPU" "$OUT/ipc_launch.txt" | head -24 | tee -a "$SUMMARY"
t0=$(date +%s)
timeout -k 5 "${RESTART_S:-120}" $PY bench/micro/ipc_restart.py > "$OUT/ipc_restart.txt" 2>&1
say "ipc_restart: rc $? in $(( $(date +%s) - t0 )) s"
sed -n '/^| step/,$p' "$OUT/ipc_restart.txt" | tee -a "$SUMMARY"
t0=$(date +%s)
timeout -k 5 "${HANDOFF_S:-150}" $PY bench/micro/handoff.py --tokens 16384 --repeats 9 --json "$OUT/handoff.json" \
    > "$OUT/handoff.log" 2>&1
say "handoff: rc $? in $(( $(date +%s) - t0 )) s"
grep -E "d2d copy  | ipc( |$)|bar" "$OUT/handoff.log" | grep -v "new connection" | head -48 | tee -a "$SUMMARY"
if [ -z "${SKIP_TESTS:-}" ]; then
    t0=$(date +%s)
    timeout -k 5 "${TESTS_S:-90}" $PY -m pytest -q -p no:cacheprovider tests/transfer/test_transfer_gpu.py \
        > "$OUT/transfer_gpu_tests.log" 2>&1
    say "transfer GPU tests: rc $? in $(( $(date +%s) - t0 )) s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/transfer_gpu_tests.log" | tail -1)"
    grep -E "^(FAILED|ERROR) " "$OUT/transfer_gpu_tests.log" | cut -c1-220 | head -12 | tee -a "$SUMMARY"
fi
