#!/usr/bin/env bash
# Issue 19's bars in one device call (about 560 s), after bench/device/decode_modes_check.sh has picked the defaults:
# engine_speed's decode rows (b=1 and b=64, 1k context; deterministic b=1) and the 8k prefill row for
# llama8b and hybrid8b, each against transformers in the same run (compiled where its budget allows),
# then the ipc control plane's GPU tests and the 16k-token ipc handoff (bench/micro/handoff.py) against
# the device copy. Every step under timeout -k; logs under $OUT, the summary last.
#   OUT=... bash bench/device/engine_speed_bars.sh ["engine flags", e.g. "--no-pdl --gemv-rows 0 --no-launch-ahead"] [bench budget s]
set -u
OUT=${OUT:-/tmp/engine_speed_bars}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
FLAGS=${1:-}
BUDGET=${2:-380}
T="timeout -k 10"
t0=$(date +%s)
# shellcheck disable=SC2086  # FLAGS are several words
$T $(( BUDGET + 20 )) $PY bench/micro/engine_speed.py --models llama8b,hybrid8b --modes default,deterministic \
    --batches 1,64 --contexts 1024 --prefill 8192 --det-batches 1 --det-contexts 1024 --det-prefill "" \
    --hf --hf-compile-budget-s 40 --hicache-gb 0 --steps 8 --prefill-reps 2 --time-budget-s "$BUDGET" \
    --out "$OUT" --tag final $FLAGS > "$OUT/bench.log" 2>&1
say "engine_speed ($FLAGS): rc $? $(( $(date +%s) - t0 )) s"
grep -E "Error|error" "$OUT/bench.log" | head -5 | tee -a "$SUMMARY"
t0=$(date +%s)
# the ipc control plane's GPU paths first: the copy+hash kernel's sums, the two-process arena handoff
# whose gather ends after its offer (the interprocess event)
$T 90 $PY -m pytest -q -p no:cacheprovider tests/pdkernels/test_kernels_copy_hash.py tests/transfer/test_transfer_gpu.py \
    > "$OUT/transfer_tests.log" 2>&1
say "transfer GPU tests: rc $? $(( $(date +%s) - t0 )) s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/transfer_tests.log" | tail -1)"
grep -E "^(FAILED|ERROR)" "$OUT/transfer_tests.log" | head -10 | tee -a "$SUMMARY"
t0=$(date +%s)
$T 70 $PY bench/micro/handoff.py --tokens 16384 --repeats 8 --json "$OUT/handoff.json" > "$OUT/handoff.log" 2>&1
say "handoff: rc $? $(( $(date +%s) - t0 )) s"
sed -n '/^ceilings/,$p' "$OUT/bench.log" | tail -16 | tee -a "$SUMMARY"
grep -E "ipc|copy|^bar" "$OUT/handoff.log" | tail -24 | tee -a "$SUMMARY"
