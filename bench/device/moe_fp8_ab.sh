#!/usr/bin/env bash
# FP8 MoE engine rows of this tree against a packed baseline commit's, in one device call: the FP8 and MoE
# GPU tests, then engine_speed.py's Qwen3-30B-A3B-shaped rows with --quantization fp8 from the baseline tree
# and from this one, and this tree's bf16 rows beside them (decode b=1 and b=64 at 1k context, an 8k
# prefill; MODEL=llama8b for the dense rows). The baseline travels as .trees/<sha>.tar.gz (python bench/speed_guard.py pack <commit>).
#   OUT=... bash bench/device/moe_fp8_ab.sh <baseline sha prefix> [--tiny]     (carry .whl and .trees)
set -u
OUT=${OUT:-/tmp/moe_fp8_ab}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
BASE=$(ls .trees/"$1"*.tar.gz | head -1)
TINY=${2:-}
if [ -z "$TINY" ]; then
    t0=$(date +%s)
    timeout -k 10 "${TESTS_S:-150}" $PY -m pytest -q -p no:cacheprovider tests/engine/layers/test_fp8_cuda.py \
        tests/pdkernels/test_kernels_fp8_gemm.py tests/pdkernels/test_kernels_moe_gpu.py -k "qwen3_moe or fp8 or gemv" \
        > "$OUT/tests.log" 2>&1
    say "tests: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
    grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | cut -c1-220 | head -12 | tee -a "$SUMMARY"
fi
base_dir=/tmp/moe_fp8_base && rm -rf "$base_dir" && mkdir -p "$base_dir" && tar xzf "$BASE" -C "$base_dir"
row() {  # tree dir, tag, extra engine_speed args
    (cd "$1" && PYTHONPATH="$1:${PYTHONPATH}" timeout -k 10 "${ROW_S:-150}" $PY bench/micro/engine_speed.py \
        --models "${MODEL:-qwen3_30b_a3b}" --modes default --batches 1,64 --contexts 1024 --prefill 8192 --no-hf \
        --hicache-gb 0 --steps 16 --out "$OUT" --tag "$2" $3 $TINY > "$OUT/engine_$2.log" 2>&1)
    say "engine_speed $2: rc $?"
}
row "$base_dir" base_fp8 "--quantization fp8"
row "$PWD" head_fp8 "--quantization fp8"
tags="base_fp8 head_fp8"
if [ -z "${SKIP_BF16:-}" ]; then  # SKIP_BF16=1: a speed guard in the same call has this tree's bf16 rows
    row "$PWD" head_bf16 ""
    tags="$tags head_bf16"
fi
for tag in $tags; do  # each run's table, under its tag
    say "== $tag"
    sed -n '/^ceilings/,$p' "$OUT/engine_$tag.log" | grep -v "^wrote" | tee -a "$SUMMARY"
done
