#!/usr/bin/env bash
# Issue 19's decode rows on one H200, in one device call (about 560 s):
#  1. smoke: the programmatic-dependent-launch (PDL) tests alone, first: PDL had never run on hardware
#     when this was written; if they fail or time out, the PDL modes below are dropped;
#  2. the GPU tests of the kernels and decode paths this work touches;
#  3. the small-batch GEMV against cuBLAS (bench/micro/gemv.py --quick);
#  4. engine_speed's decode rows (and an 8k prefill) per mode: default (the small-batch GEMV, PDL, launch-ahead and
#     the decode rows' q/k norms and rotary inside the attention kernel), each of them switched off alone
#     (default-nogemv, -nopdl, -noahead, -norope), all of the first three off (default-plain), deterministic;
#  5. a per-kernel profile of the decode step and of one 8k prefill (bench/micro/profile_decode.py).
# Every step has its own time limit (timeout -k: a hung GPU call cannot hold the rest). Logs under
# $OUT, the summary last.
#   OUT=... bash bench/device/decode_modes_check.sh [models] [batches] [bench budget s] [profile models]
set -u
OUT=${OUT:-/tmp/decode_modes_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
MODELS=${1:-llama8b,hybrid8b}
BATCHES=${2:-1,64}
BUDGET=${3:-180}
PROFILE=${4:-hybrid8b}
T="timeout -k 10"
t0=$(date +%s)
$T 75 $PY -m pytest -q -p no:cacheprovider tests/pdkernels/test_kernels_gemv.py -k pdl \
    tests/engine/execution/test_engine_cuda_decode.py::test_pdl_changes_no_number > "$OUT/smoke.log" 2>&1
rc=$?
say "smoke (PDL): rc $rc $(( $(date +%s) - t0 )) s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/smoke.log" | tail -1)"
MODES=default,default-nogemv,default-noahead,default-plain,default-norope,deterministic,default-nopdl
FAST=
if [ $rc -ne 0 ]; then  # PDL failed: every mode without it
    MODES=default-nopdl,default-plain,deterministic-nopdl
    FAST=--no-pdl
fi
t0=$(date +%s)
$T 150 $PY -m pytest -q -p no:cacheprovider tests/pdkernels/test_kernels_gemv.py tests/pdkernels/test_kernels_fused_gpu.py \
    tests/engine/execution/test_engine_cuda_decode.py tests/pdkernels/test_kernels_bi_gpu.py tests/pdkernels/test_kernels_attn_gpu.py \
    > "$OUT/tests.log" 2>&1
say "tests: rc $? $(( $(date +%s) - t0 )) s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -1)"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 | tee -a "$SUMMARY"
t0=$(date +%s)
$T 60 $PY bench/micro/gemv.py --quick --batches 1 --out "$OUT" > "$OUT/gemv.log" 2>&1
say "gemv: rc $? $(( $(date +%s) - t0 )) s"
grep -E "^(copy|shape|qkv|o |gate_up|down)" "$OUT/gemv.log" | tee -a "$SUMMARY"
t0=$(date +%s)
$T $(( BUDGET + 20 )) $PY bench/micro/engine_speed.py --models "$MODELS" --modes "$MODES" --batches "$BATCHES" \
    --contexts 1024 --prefill 8192 --prefill-reps 2 --det-batches 1 --det-contexts 1024 --det-prefill "" --no-hf --hicache-gb 0 \
    --steps 8 --time-budget-s "$BUDGET" --out "$OUT" --tag decode > "$OUT/bench.log" 2>&1
say "engine_speed ($MODES): rc $? $(( $(date +%s) - t0 )) s"
grep -E "Error|error" "$OUT/bench.log" | head -5 | tee -a "$SUMMARY"
for m in ${PROFILE//,/ }; do
    t0=$(date +%s)
    $T 100 $PY bench/micro/profile_decode.py --model "$m" --batches "$BATCHES" --context 1024 --out "$OUT" --prefill 8192 \
        $FAST > "$OUT/profile_$m.log" 2>&1
    say "profile $m (${FAST:-default flags}): rc $? $(( $(date +%s) - t0 )) s"
done
sed -n '/^ceilings/,$p' "$OUT/bench.log" | tail -30 | tee -a "$SUMMARY"
for m in ${PROFILE//,/ }; do grep -E -A14 "^b=|^prefill" "$OUT/profile_$m.log" | cut -c1-140 | tee -a "$SUMMARY"; done
