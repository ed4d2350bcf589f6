#!/usr/bin/env bash
# DeepSeek-V3-family work (latent attention) on one GPU, in one device call:
#   1. its GPU tests: the paged latent decode kernel and its latent store, the tiny deepseek_v3 engines
#      against transformers on CUDA (graphs and eager, default and deterministic), the CUDA decode path's
#      checks with deepseek_v3 among the families, and P/D pairs over tcp and ipc against a single engine
#      (PDSERVE_TOKENIZER_DIR: SmolLM2's tokenizer files, carried in .dev/smollm2-tok);
#   2. engine_speed.py's rows for a DeepSeek-V2-Lite-shaped and a DeepSeek-V3-shaped (5 layers: 3 dense,
#      2 MoE) dummy model: decode b=1 and b=64 at 1k and 8k context against the copy ceiling counting the
#      bytes a step really reads (latent KV, the experts its tokens selected), an 8k prefill against the
#      matmul ceiling, transformers in the same run;
#   3. bench/micro/handoff.py: a 16k-token handoff of DeepSeek-V3's latent pages and llama8b's (bytes per
#      token and layer, tcp and ipc against their ceilings).
# Logs under $OUT, a summary last ($OUT/summary.txt); each step has its own limit (TESTS_S, ENGINE_S,
# HANDOFF_S); SKIP_TESTS=1, SKIP_ENGINE=1, SKIP_HANDOFF=1 leave a step out.   bash bench/device/mla_check.sh      (carry .whl and .dev)
set -u
OUT=${OUT:-/tmp/mla_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export PDSERVE_TOKENIZER_DIR=${PDSERVE_TOKENIZER_DIR:-$ROOT/.dev/smollm2-tok}

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    t0=$(date +%s)
    timeout -k 10 "${TESTS_S:-240}" $PY -m pytest -q -p no:cacheprovider -m cuda --durations=6 \
        tests/pdkernels/test_kernels_mla_decode.py tests/engine/models/test_deepseek_v3.py tests/pd/disagg/test_pair_deepseek_gpu.py \
        > "$OUT/tests.log" 2>&1
    say "gpu tests: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
    t0=$(date +%s)  # the CUDA decode path's checks, deepseek_v3's cases (the other families' ran before)
    timeout -k 10 "${DECODE_TESTS_S:-120}" $PY -m pytest -q -p no:cacheprovider -m cuda -k deepseek \
        tests/engine/execution/test_engine_cuda_decode.py > "$OUT/tests_decode.log" 2>&1
    say "cuda decode tests (deepseek_v3): rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests_decode.log")"
    grep -hE "^(FAILED|ERROR) " "$OUT/tests.log" "$OUT/tests_decode.log" | cut -c1-240 | head -20 | tee -a "$SUMMARY"
fi

if [ "${SKIP_ENGINE:-0}" != 1 ]; then
t0=$(date +%s)
timeout -k 10 "${ENGINE_S:-330}" $PY bench/micro/engine_speed.py --models "${MODELS:-deepseek_v2_lite,deepseek_v3_5l}" \
    --modes default --batches 1,64 --contexts 1024,8192 --prefill 8192 --hf --no-hf-compile --hicache-gb 0 \
    --steps 8 --time-budget-s "${ENGINE_BUDGET_S:-310}" --out "$OUT" --tag mla > "$OUT/engine.log" 2>&1
say "engine_speed: rc $? in $(( $(date +%s) - t0 )) s"
grep -E "^== " "$OUT/engine.log" | tee -a "$SUMMARY"
sed -n '/^ceilings/,$p' "$OUT/engine.log" | tee -a "$SUMMARY"
grep -E "Error|error:" "$OUT/engine.log" | sort | uniq -c | head -8 | tee -a "$SUMMARY"
fi

[ "${SKIP_HANDOFF:-0}" = 1 ] && exit 0
t0=$(date +%s)
for layout in deepseek_v3 llama8b; do
    timeout -k 5 "${HANDOFF_S:-60}" $PY bench/micro/handoff.py --layout $layout --tokens 16384 --repeats 3 \
        > "$OUT/handoff_$layout.log" 2>&1
    say "handoff $layout: rc $?"
    grep -E "^# $layout|handoff (tcp|ipc) |device copy|raw tcp" "$OUT/handoff_$layout.log" | tee -a "$SUMMARY"
done
say "handoffs in $(( $(date +%s) - t0 )) s"
