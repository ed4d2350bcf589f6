#!/usr/bin/env bash
# The decode path on one GPU, in one device call: kernel tests (with their GB/s), the CUDA decode
# engine tests, a profile of llama8b decode steps (bench/micro/profile_decode.py), decode rows of engine_speed.py (default and deterministic), and optionally the
# synthetic golden/determinism checks of bench/checks/gpu_golden.py. Logs under $OUT; a summary last.
#   bash bench/device/decode_check.sh [bench models] [batches] [extra: golden]
set -u
OUT=${OUT:-/tmp/decode_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MODELS=${1:-llama8b}
BATCHES=${2:-1,64}
EXTRA=${3:-}
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
t0=$(date +%s)
timeout 100 $PY -m pytest -q -s tests/pdkernels/test_kernels_attn_gpu.py tests/pdkernels/test_kernels_fused_gpu.py 2>&1 \
    | tee "$OUT/kernels.log" | grep -E "GB/s|passed|failed|Error" ; echo "kernels: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 80 $PY bench/micro/profile_decode.py --model llama8b --batches "$BATCHES" --context 1024 --out "$OUT" \
    > "$OUT/profile.log" 2>&1; echo "profile: rc $? $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 170 $PY bench/micro/engine_speed.py --models "$MODELS" --modes default,deterministic --batches "$BATCHES" \
    --contexts 1024 --prefill "" --det-batches "$BATCHES" --det-contexts 1024 --det-prefill "" --no-hf \
    --hicache-gb 0 --steps 8 --out "$OUT" --tag decode > "$OUT/bench.log" 2>&1
echo "bench: rc $? $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 90 $PY -m pytest -q tests/engine/execution/test_engine_cuda_decode.py 2>&1 | tee "$OUT/engine_tests.log" | tail -2
echo "engine tests: $(( $(date +%s) - t0 )) s"
if [ "$EXTRA" = golden ]; then
    t0=$(date +%s)
    timeout 80 $PY bench/checks/gpu_golden.py --synthetic smollm2-135m --checks golden --out "$OUT" > "$OUT/gpu_golden.log" 2>&1
    echo "gpu_golden: rc $? $(( $(date +%s) - t0 )) s"; sed -n '/== gpu_golden summary/,$p' "$OUT/gpu_golden.log"
fi
grep -E "Error|error" "$OUT/bench.log" | head -10
grep -E -A12 "^b=" "$OUT/profile.log" | cut -c1-150
sed -n '/^ceilings/,$p' "$OUT/bench.log" | tail -12
