#!/usr/bin/env bash
# The GPU test suite (pytest -m cuda) in parts that each fit one device call, or all of them in one:
#   kernels   tests/pdkernels (the Triton kernels against torch)
#   engine    tests/engine (CUDA decode, graphs, determinism, MoE, gpt-oss)
#   rest      everything else marked cuda (transfer on the GPU, the golden check, ...)
# Each part runs under its own limit (KERNELS_S, ENGINE_S, REST_S seconds) and writes its log and a
# JUnit file to $OUT; the summary gives each part's counts and failures.
#   OUT=... bash bench/device/gpu_tests.sh [part ...]       (default: kernels engine rest)
set -u
OUT=${OUT:-/tmp/gpu_tests}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
PARTS=${*:-kernels engine rest}
rc_all=0
for part in $PARTS; do
    case $part in
        kernels) paths="tests/pdkernels"; limit=${KERNELS_S:-200} ;;
        engine) paths="tests/engine"; limit=${ENGINE_S:-240} ;;
        rest) paths="tests --ignore=tests/pdkernels --ignore=tests/engine"; limit=${REST_S:-150} ;;
        *) say "unknown part $part (kernels, engine, rest)"; exit 2 ;;
    esac
    t0=$(date +%s)
    # shellcheck disable=SC2086  # paths holds several arguments
    timeout -k 10 "$limit" $PY -m pytest -q -p no:cacheprovider -m cuda -o junit_family=xunit2 \
        --junitxml "$OUT/gpu_tests_$part.xml" --durations=8 $paths > "$OUT/gpu_tests_$part.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || rc_all=$rc
    counts=$(grep -E "[0-9]+ (passed|failed|skipped|error|deselected).* in [0-9.]+s" "$OUT/gpu_tests_$part.log" | tail -1)
    say "gpu tests $part: rc $rc in $(( $(date +%s) - t0 )) s (limit $limit): ${counts:-no count (cut off?)}"
    grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests_$part.log" | cut -c1-220 | head -20 | tee -a "$SUMMARY"
done
exit $rc_all
