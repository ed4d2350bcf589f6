#!/usr/bin/env bash
# FP8 latent attention on one GPU, one device call (issue 53 item 1):
#   1. the CUDA tests that cover it: the FP8 paths against the dequantizing path, the tiny deepseek_v3 engines
#      against transformers on CUDA;
#   2. engine_speed.py's rows for the DeepSeek-V3 shape (5 layers: 3 dense, 2 MoE), bf16 and FP8 dummy
#      weights as the release ships them (bench/configs/deepseek_v3_5l_fp8.json: quantization_config) in the
#      same process: decode b=1 and b=64 at 1k and 8k context, an 8k prefill;
#   3. the FP8 rows again with the tree of BASE (packed in .trees: python bench/speed_guard.py pack BASE), where
#      kv_b_proj was dequantized twice a layer every step.
# Carry .whl and .trees.   OUT=... BASE=e88a79f bash bench/device/mla_fp8_check.sh
set -u
OUT=${OUT:-/tmp/mla_fp8_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
BASE=${BASE:-e88a79f}
GRID=(--modes default --batches 1,64 --contexts 1024,8192 --prefill 8192 --no-hf --hicache-gb 0 --steps 8)

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    t0=$(date +%s)
    timeout -k 10 "${TESTS_S:-150}" $PY -m pytest -q -p no:cacheprovider -m cuda tests/engine/layers/test_fp8_cuda.py \
        tests/engine/models/test_deepseek_v3.py > "$OUT/tests.log" 2>&1
    say "gpu tests: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
    grep -hE "^(FAILED|ERROR) " "$OUT/tests.log" | cut -c1-240 | head -10 | tee -a "$SUMMARY"
fi

mkdir -p /tmp/dsv3_fp8 && cp bench/configs/deepseek_v3_5l_fp8.json /tmp/dsv3_fp8/config.json
t0=$(date +%s)
timeout -k 10 "${HEAD_S:-240}" $PY bench/micro/engine_speed.py --models deepseek_v3_5l_fp8,deepseek_v3_5l "${GRID[@]}" \
    --time-budget-s 220 --out "$OUT" --tag head > "$OUT/engine_head.log" 2>&1
say "engine_speed HEAD (fp8, bf16): rc $? in $(( $(date +%s) - t0 )) s"

t0=$(date +%s)
base=$(ls .trees/"$BASE"*.tar.gz | head -1)
mkdir -p /tmp/base && tar -xzf "$base" -C /tmp/base
PYTHONPATH="/tmp/site:/tmp/base" timeout -k 10 "${BASE_S:-150}" $PY /tmp/base/bench/micro/engine_speed.py --models /tmp/dsv3_fp8 \
    "${GRID[@]}" --time-budget-s 130 --out "$OUT" --tag base > "$OUT/engine_base.log" 2>&1
say "engine_speed $BASE (fp8): rc $? in $(( $(date +%s) - t0 )) s"
$PY bench/micro/engine_speed.py --merge "$OUT"/engine_speed_head.json "$OUT"/engine_speed_base.json > "$OUT/engine_table.txt" 2>&1
cat "$OUT/engine_table.txt" >> "$SUMMARY"
grep -hE "Error|error:" "$OUT/engine_head.log" "$OUT/engine_base.log" | sort | uniq -c | head -8 | tee -a "$SUMMARY"
