#!/usr/bin/env bash
# Speculative decoding on the GPU, one device call: its CUDA tests (verify as decode rows and graphs, the
# prefill path for sliding models; tokens identical to no speculation), the CUDA decode path's tests it
# touches, then bench/micro/spec_verify.py (verify cost for k = 1..7 at batch 1, 8, 64 against a plain
# step; forced-acceptance tokens/s) on llama8b-shaped dummy weights. Carry .whl (bench/device/wheels.sh).
#   OUT=... bash bench/device/spec_check.sh
set -u
OUT=${OUT:-/tmp/spec_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
timeout -k 10 200 $PY -m pytest -q -x -p no:cacheprovider tests/engine/speculative/test_speculator_cuda.py tests/engine/speculative/test_mtp_drafts.py \
    tests/engine/execution/test_engine_cuda_decode.py 2>&1 | tail -15 > "$OUT/tests.txt"
say "tests: $(tail -1 "$OUT/tests.txt")"
timeout -k 10 300 $PY bench/micro/spec_verify.py --out "$OUT" 2>&1 | tail -40 > "$OUT/spec_verify.log"
cat "$OUT/spec_verify.txt" >> "$SUMMARY" 2>/dev/null || { say "spec_verify: no table"; tail -20 "$OUT/spec_verify.log" >> "$SUMMARY"; }
