#!/usr/bin/env bash
# Issue 19's decode rows on one H200, in one device call: the GPU tests of the kernels this work
# touches, the small-batch GEMV against cuBLAS (bench/bench_gemv.py), bench_engine's decode rows with
# each new piece switched off in turn (default-cublas: no GEMV; default-nopdl: no programmatic
# dependent launch; default-plain: neither), and a per-kernel profile of the decode step. Logs under
# $OUT, the summary last.
#   OUT=... bash bench/speed2_check.sh [models] [batches] [modes] [bench budget s] [profile models]
set -u
OUT=${OUT:-/tmp/speed2_check}
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
MODELS=${1:-llama8b,hybrid8b}
BATCHES=${2:-1,64}
MODES=${3:-default,default-cublas,default-nopdl,default-plain,deterministic}
BUDGET=${4:-200}
PROFILE=${5:-hybrid8b}
t0=$(date +%s)
timeout 140 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_gemv.py tests/kernels/test_kernels_fused_gpu.py \
    tests/engine/test_engine_cuda_decode.py tests/kernels/test_kernels_bi_gpu.py tests/kernels/test_kernels_attn_gpu.py \
    > "$OUT/tests.log" 2>&1
say "tests: rc $? $(( $(date +%s) - t0 )) s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -1)"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 | tee -a "$SUMMARY"
t0=$(date +%s)
timeout 70 $PY bench/bench_gemv.py --quick --batches 1 --out "$OUT" > "$OUT/gemv.log" 2>&1
say "gemv: rc $? $(( $(date +%s) - t0 )) s"
grep -E "^(copy|shape|qkv|o |gate_up|down)" "$OUT/gemv.log" | tee -a "$SUMMARY"
t0=$(date +%s)
timeout $(( BUDGET + 30 )) $PY bench/bench_engine.py --models "$MODELS" --modes "$MODES" --batches "$BATCHES" \
    --contexts 1024 --prefill "" --det-batches 1 --det-contexts 1024 --det-prefill "" --no-hf --hicache-gb 0 \
    --steps 8 --time-budget-s "$BUDGET" --out "$OUT" --tag decode > "$OUT/bench.log" 2>&1
say "bench_engine: rc $? $(( $(date +%s) - t0 )) s"
grep -E "Error|error" "$OUT/bench.log" | head -5 | tee -a "$SUMMARY"
for m in ${PROFILE//,/ }; do
    t0=$(date +%s)
    timeout 110 $PY bench/profile_decode.py --model "$m" --batches "$BATCHES" --context 1024 --out "$OUT" --prefill 8192 \
        > "$OUT/profile_$m.log" 2>&1
    say "profile $m: rc $? $(( $(date +%s) - t0 )) s"
done
sed -n '/^ceilings/,$p' "$OUT/bench.log" | tail -16 | tee -a "$SUMMARY"
for m in ${PROFILE//,/ }; do grep -E -A14 "^b=|^prefill" "$OUT/profile_$m.log" | cut -c1-140 | tee -a "$SUMMARY"; done
