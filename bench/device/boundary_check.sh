#!/usr/bin/env bash
# After a change to the engine/transfer boundary, in one device call: every GPU test (kernels, CUDA
# decode, the SDPA path, determinism, the handoff on the GPU: checksum, tcp staging, CUDA ipc, the ipc
# arena), then the speed rows that the change could move: engine_speed.py decode (b=1, 64 at 1k) and an
# 8k prefill for llama8b and hybrid8b in default mode, and handoff.py's 16k-token llama8b handoff
# (tcp and ipc) against its ceilings. Logs under $OUT, a summary last ($OUT/summary.txt). About 8
# minutes on an H200; each step has its own limit (TESTS_S, ENGINE_S, HANDOFF_S).
#   bash bench/device/boundary_check.sh            (wheels in .whl/ are installed into /tmp/site first)
set -u
OUT=${OUT:-/tmp/boundary_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

t0=$(date +%s)
timeout "${TESTS_S:-260}" $PY -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/pdkernels/test_kernels_gpu.py tests/pdkernels/test_kernels_attn_gpu.py tests/pdkernels/test_kernels_prefill_gpu.py \
    tests/pdkernels/test_kernels_bi_gpu.py tests/pdkernels/test_kernels_fused_gpu.py \
    tests/engine/execution/test_engine_cuda_decode.py tests/engine/layers/test_attention_sdpa_gpu.py tests/engine/layers/test_engine_determinism.py \
    tests/engine/core/test_engine_memory.py tests/engine/handoff/test_pd_lifecycle.py tests/transfer tests/test_layers.py \
    > "$OUT/tests.log" 2>&1
say "gpu tests: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
grep -E "FAILED|Error" "$OUT/tests.log" | head -20 | tee -a "$SUMMARY"

t0=$(date +%s)
timeout "${ENGINE_S:-220}" $PY bench/micro/engine_speed.py --models llama8b,hybrid8b --modes default --batches 1,64 \
    --contexts 1024 --prefill 8192 --no-hf --hicache-gb 0 --steps 8 --out "$OUT" --tag boundary \
    > "$OUT/engine.log" 2>&1
say "engine_speed: rc $? in $(( $(date +%s) - t0 )) s"
sed -n '/^ceilings/,$p' "$OUT/engine.log" | tee -a "$SUMMARY"

t0=$(date +%s)
timeout "${HANDOFF_S:-120}" $PY bench/micro/handoff.py --device cuda --layout llama8b --tokens 16384 --repeats 5 \
    --json "$OUT/handoff.json" > "$OUT/handoff.log" 2>&1
say "handoff: rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^ +[0-9]+ +[0-9]+ +(raw|device|handoff|payload|checksum|export)|^bar" "$OUT/handoff.log" | tee -a "$SUMMARY"
