#!/usr/bin/env bash
# The MoE work on one GPU, in one device call: its GPU tests (the Triton grouped GEMM, the MoE layers and
# engines on CUDA: qwen3_moe and gpt_oss, attention sinks in the kernels, the engine's other kernel
# tests that the sink parameter touches), then engine_speed.py's rows for a Qwen3-30B-A3B-shaped and a
# gpt-oss-20b-shaped dummy model (bf16, --ep 1): decode at batch 1 and 64 (1k context) against the copy
# ceiling counting the bytes a step really reads (attention, router, the experts its tokens selected),
# an 8k prefill against the matmul ceiling, and transformers on the same shapes in the same run; then
# moe_layer.py's layer-level table. Logs under $OUT, a summary last ($OUT/summary.txt). Each step has
# its own limit (TESTS_S, ENGINE_S, LAYER_S).
#   bash bench/device/moe_check.sh            (wheels in .whl/ are installed into /tmp/site first)
set -u
OUT=${OUT:-/tmp/moe_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

t0=$(date +%s)
TESTS=$(ls tests/pdkernels/test_kernels_moe_gpu.py tests/pdkernels/test_kernels_moe_route.py tests/engine/layers/test_moe.py tests/engine/models/test_gpt_oss.py \
    tests/pdkernels/test_kernels_attn_gpu.py tests/pdkernels/test_kernels_prefill_gpu.py tests/pdkernels/test_kernels_sinks*.py \
    tests/engine/execution/test_engine_cuda_decode.py 2>/dev/null)
timeout "${TESTS_S:-200}" $PY -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
say "gpu tests: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
grep -E "FAILED|Error" "$OUT/tests.log" | head -20 | tee -a "$SUMMARY"

t0=$(date +%s)
timeout "${ENGINE_S:-300}" $PY bench/micro/engine_speed.py --models "${MODELS:-qwen3_30b_a3b,gpt_oss_20b}" --modes default \
    --batches 1,64 --contexts 1024 --prefill 8192 --hf --no-hf-compile --hicache-gb 0 --steps 8 \
    --time-budget-s "${ENGINE_BUDGET_S:-280}" --out "$OUT" --tag moe > "$OUT/engine.log" 2>&1
say "engine_speed: rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^== " "$OUT/engine.log" | tee -a "$SUMMARY"
sed -n '/^ceilings/,$p' "$OUT/engine.log" | tee -a "$SUMMARY"

t0=$(date +%s)
timeout "${LAYER_S:-60}" $PY bench/micro/moe_layer.py > "$OUT/layer.log" 2>&1
say "moe_layer: rc $? in $(( $(date +%s) - t0 )) s"
tail -20 "$OUT/layer.log" | tee -a "$SUMMARY"
