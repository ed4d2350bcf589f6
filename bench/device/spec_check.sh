#!/usr/bin/env bash
# Speculative decoding on the GPU, one device call: its CUDA tests (verify as decode rows and graphs, a
# sliding layer one launch per row of a sequence; tokens and logprobs identical to no speculation), the
# CUDA decode path's tests it touches, then bench/micro/spec_verify.py (verify cost for k = 1..7 at batch
# 1, 8, 64 against a plain step; forced-acceptance tokens/s) on llama8b-shaped dummy weights, and at
# batch 1, 8 on hybrid8b's. Carry .whl (bench/device/wheels.sh).
#   OUT=... bash bench/device/spec_check.sh
set -u
OUT=${OUT:-/tmp/spec_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
timeout -k 10 240 $PY -m pytest -q -p no:cacheprovider tests/engine/speculative/test_speculator_cuda.py tests/engine/speculative/test_mtp_drafts.py tests/engine/speculative/test_draft_model.py \
    tests/engine/execution/test_engine_cuda_decode.py -k cuda > "$OUT/tests_full.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests_full.txt" | tail -15 > "$OUT/tests.txt"
say "tests: $(tail -1 "$OUT/tests.txt")"
if [ "${LLAMA:-1}" = 1 ]; then  # LLAMA=0: the hybrid's rows only
    timeout -k 10 300 $PY bench/micro/spec_verify.py --out "$OUT" 2>&1 | tail -40 > "$OUT/spec_verify.log"
    cat "$OUT/spec_verify.txt" >> "$SUMMARY" 2>/dev/null || { say "spec_verify: no table"; tail -20 "$OUT/spec_verify.log" >> "$SUMMARY"; }
fi
# a hybrid model (sliding layers: a verify takes one launch per row of a sequence there)
timeout -k 10 200 $PY bench/micro/spec_verify.py --model hybrid8b --batches 1,8 --gen-batches 1 --reps 10 \
    --out "$OUT/hybrid" 2>&1 | tail -40 > "$OUT/spec_verify_hybrid.log"
cat "$OUT/hybrid/spec_verify.txt" >> "$SUMMARY" 2>/dev/null || { say "spec_verify hybrid8b: no table"; tail -20 "$OUT/spec_verify_hybrid.log" >> "$SUMMARY"; }
