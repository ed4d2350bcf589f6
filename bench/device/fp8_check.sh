#!/usr/bin/env bash
# FP8 on the GPU, in one device call per part (PARTS, default "tests probe"):
#   tests   the FP8 kernel tests under CUDA (the block-scaled GEMM, the GEMV and the grouped MoE GEMM with
#           FP8 weights) and the engine's FP8 paths against the dequantizing path (tests/engine/layers/test_fp8_cuda.py)
#   probe   bench/micro/fp8_gemm_probe.py at llama8b's linear shapes against bf16 and the ceilings of the
#           same run (device copy; torch._scaled_mm), with a sweep of tile settings
#   engine  engine_speed.py's rows for llama8b and a Qwen3-30B-A3B shape, bf16 then --quantization fp8 in
#           the same call: decode b=1 and b=64 (1k context), an 8k prefill
#   OUT=... PARTS="tests probe" bash bench/device/fp8_check.sh
set -u
OUT=${OUT:-/tmp/fp8_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
for part in ${PARTS:-tests probe}; do
    t0=$(date +%s)
    case $part in
    tests)
        timeout -k 10 "${TESTS_S:-240}" $PY -m pytest -q -p no:cacheprovider -m cuda tests/pdkernels/test_kernels_fp8_gemm.py \
            tests/pdkernels/test_kernels_gemv.py tests/engine/layers/test_fp8_cuda.py "tests/pdkernels/test_kernels_moe_gpu.py" \
            > "$OUT/fp8_tests.log" 2>&1
        say "fp8 tests: rc $? in $(( $(date +%s) - t0 )) s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/fp8_tests.log" | tail -1)"
        grep -E "^(FAILED|ERROR) " "$OUT/fp8_tests.log" | cut -c1-220 | head -12 | tee -a "$SUMMARY" ;;
    probe)
        timeout -k 10 "${PROBE_S:-300}" $PY bench/micro/fp8_gemm_probe.py --ms "${MS:-1,8,64,8192}" --sweep \
            --out "$OUT/fp8_probe.txt" > "$OUT/fp8_probe.log" 2>&1
        say "fp8 probe: rc $? in $(( $(date +%s) - t0 )) s"
        cat "$OUT/fp8_probe.txt" >> "$SUMMARY" 2>/dev/null || tail -20 "$OUT/fp8_probe.log" | tee -a "$SUMMARY" ;;
    engine)
        for q in none fp8; do
            for model in ${MODELS:-llama8b qwen3_30b_a3b}; do
                extra=$([ "$q" = fp8 ] && echo "--quantization fp8")
                # shellcheck disable=SC2086  # extra is empty or two words
                timeout -k 10 "${ROW_S:-150}" $PY bench/micro/engine_speed.py --models "$model" --modes default \
                    --batches 1,64 --contexts 1024 --prefill 8192 --no-hf --hicache-gb 0 --steps 16 $extra \
                    --out "$OUT" --tag "${model}_$q" > "$OUT/engine_${model}_$q.log" 2>&1
                say "engine_speed $model $q: rc $?"
            done
        done
        $PY bench/micro/engine_speed.py --merge "$OUT"/engine_speed_*.json > "$OUT/engine_table.txt" 2>&1
        cat "$OUT/engine_table.txt" >> "$SUMMARY" ;;
    esac
done
