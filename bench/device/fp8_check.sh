#!/usr/bin/env bash
# FP8 on the GPU, one device call: the FP8 kernel tests (pdkernels/fp8_gemm.py, the GEMV with an FP8
# weight) under CUDA, then bench/micro/fp8_gemm_probe.py at llama8b's linear shapes against bf16 and the
# ceilings of the same run (device copy; torch._scaled_mm), with a sweep of tile settings.
#   OUT=... bash bench/device/fp8_check.sh [ms]       (default 1,8,64,8192)
set -u
OUT=${OUT:-/tmp/fp8_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
MS=${1:-1,8,64,8192}
timeout -k 10 200 $PY -m pytest -q -p no:cacheprovider -m cuda tests/pdkernels/test_kernels_fp8_gemm.py \
    tests/pdkernels/test_kernels_gemv.py > "$OUT/fp8_tests.log" 2>&1
say "fp8 kernel tests: rc $? $(grep -E '[0-9]+ (passed|failed)' "$OUT/fp8_tests.log" | tail -1)"
grep -E "^(FAILED|ERROR) " "$OUT/fp8_tests.log" | cut -c1-220 | head -10 | tee -a "$SUMMARY"
timeout -k 10 ${PROBE_S:-300} $PY bench/micro/fp8_gemm_probe.py --ms "$MS" --sweep --out "$OUT/fp8_probe.txt" \
    > "$OUT/fp8_probe.log" 2>&1
say "fp8 probe: rc $?"
cat "$OUT/fp8_probe.txt" >> "$SUMMARY" 2>/dev/null || tail -20 "$OUT/fp8_probe.log" | tee -a "$SUMMARY"
