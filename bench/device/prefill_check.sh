#!/usr/bin/env bash
# The prefill path and deterministic mode on one GPU, in one device call: prefill-attention and
# batch-invariant matmul kernel tests, the CUDA determinism tests, llama8b rows of engine_speed.py
# (default and deterministic), the kernel benchmark (bench/micro/prefill_kernels.py). Logs under $OUT,
# a summary last. Each step has its own time limit (TESTS_S, DET_S, ENGINE_S, KERNELS_S).
#   bash bench/device/prefill_check.sh [prefill tokens] [chunk] [decode batches] [steps: tests,det,engine,kernels]
set -u
OUT=${OUT:-/tmp/prefill_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PREFILL=${1:-8192}
CHUNK=${2:-8192}
BATCHES=${3:-1,8}
STEPS=${4:-tests,det,engine,kernels}
PY=${PY:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
say "$(nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader)"
say "$($PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
has() { [[ ",$STEPS," == *",$1,"* ]]; }
if has tests; then
    t0=$(date +%s)
    timeout "${TESTS_S:-100}" $PY -m pytest -q -p no:cacheprovider tests/pdkernels/test_kernels_prefill_gpu.py \
        tests/pdkernels/test_kernels_bi_gpu.py > "$OUT/kernel_tests.log" 2>&1
    say "kernel tests: rc $? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/kernel_tests.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/kernel_tests.log" | head -20 | tee -a "$SUMMARY"
fi
if has det; then
    t0=$(date +%s)
    timeout "${DET_S:-90}" $PY -m pytest -q -p no:cacheprovider tests/engine/layers/test_engine_determinism.py -k cuda \
        > "$OUT/det_tests.log" 2>&1
    say "determinism tests: rc $? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/det_tests.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/det_tests.log" | head -20 | tee -a "$SUMMARY"
fi
if has engine; then
    t0=$(date +%s)
    timeout "${ENGINE_S:-120}" $PY bench/micro/engine_speed.py --models llama8b --modes default,deterministic \
        --batches "$BATCHES" --contexts 1024 --prefill "$PREFILL" --det-batches "$BATCHES" --det-contexts 1024 \
        --det-prefill "$PREFILL" --no-hf --hicache-gb 0 --steps 8 --prefill-reps 2 --chunk "$CHUNK" \
        --out "$OUT" --tag prefill > "$OUT/engine_speed.log" 2>&1
    say "engine bench: rc $? $(( $(date +%s) - t0 )) s"
    sed -n '/^model /,$p' "$OUT/engine_speed.log" | tee -a "$SUMMARY"
fi
if has kernels; then
    t0=$(date +%s)
    timeout "${KERNELS_S:-90}" $PY bench/micro/prefill_kernels.py --out "$OUT" ${KERNEL_ARGS:-} \
        > "$OUT/bench_kernels.log" 2>&1
    say "kernel bench: rc $? $(( $(date +%s) - t0 )) s"
    sed -n '/ s on /,$p' "$OUT/bench_kernels.log" >> "$SUMMARY"
fi
echo "==== summary"
cat "$SUMMARY"
