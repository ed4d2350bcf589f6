#!/usr/bin/env bash
# The default-mode SDPA prefill path (engine/layers/attention.py) on one GPU, in one device call: which SDPA
# backend torch picks here, the SDPA path's tests (with each path's TFLOP/s on an 8B layer), the prefill
# kernel and CUDA decode tests, then engine_speed.py prefill rows (1k, 8k, 32k; no decode rows) of llama8b
# and hybrid8b with the SDPA path on (default-sdpa) and off (default-triton), against transformers. Logs
# and JSON under $OUT, a summary last. Each step has its own time limit (PROBE_S, SDPA_TESTS_S, TESTS_S,
# ENGINE_S per model); about 5-6 minutes in all on an H200.
#   bash bench/device/prefill_sdpa_check.sh [steps: probe,tests,engine] [modes] [prefill tokens]
#   e.g. modes default-sdpa,default-triton,default-cudnn to add cuDNN for chunks without a prefix;
#   MIN_PAIRS=... sets the SDPA path's threshold (engine_speed.py --prefill-sdpa-min-pairs) for the engine rows.
set -u
OUT=${OUT:-/tmp/prefill_sdpa_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${1:-probe,tests,engine}
MODES=${2:-default-sdpa,default-triton}
PREFILL=${3:-1024,8192,32768}
PY=${PY:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
has() { [[ ",$STEPS," == *",$1,"* ]]; }
say "$(nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader)"
say "$($PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cudnn", torch.backends.cudnn.version())')"
say "modes $MODES, MIN_PAIRS=${MIN_PAIRS:-default}"
if has probe; then
    # Which kernels torch's SDPA runs for an 8B layer's shapes (GQA 32/8, 128 dims, bf16): by default (what
    # transformers gets), pinned to flash, and a lower-right causal chunk after a prefix (our later chunks).
    t0=$(date +%s)
    timeout "${PROBE_S:-60}" $PY - > "$OUT/probe.log" 2>&1 <<'EOF'
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.profiler import ProfilerActivity, profile

def kernels(fn):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages() if e.device_type.name == "CUDA"}
    return sorted(n[:90] for n in names)

q = torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16)
sq = k[:, :, :4096]

def _pinned(fn):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return fn()

cases = {
    "default, is_causal, n == L": lambda: F.scaled_dot_product_attention(q, sq, sq, is_causal=True, enable_gqa=True),
    "flash pinned, is_causal": lambda: _pinned(lambda: F.scaled_dot_product_attention(q, sq, sq, is_causal=True, enable_gqa=True)),
    "default, causal_lower_right(4096, 8192)": lambda: F.scaled_dot_product_attention(
        q, k, k, attn_mask=causal_lower_right(4096, 8192), enable_gqa=True),
}
for name, fn in cases.items():
    try:
        print(f"{name}: {kernels(fn)}")
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {e}")
print("sdp priority order (1 flash, 2 efficient, 0 math, 3 cudnn):", torch._C._get_sdp_priority_order())
EOF
    say "sdpa probe: rc $? $(( $(date +%s) - t0 )) s"
    cat "$OUT/probe.log" | tee -a "$SUMMARY"
fi
if has tests; then
    t0=$(date +%s)
    timeout "${SDPA_TESTS_S:-150}" $PY -m pytest -q -s -p no:cacheprovider tests/engine/layers/test_attention_sdpa_gpu.py \
        > "$OUT/sdpa_tests.log" 2>&1
    say "sdpa path tests: rc $? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/sdpa_tests.log")"
    grep -E "^(FAILED|ERROR)|^prefix " "$OUT/sdpa_tests.log" | head -20 | tee -a "$SUMMARY"
    t0=$(date +%s)
    timeout "${TESTS_S:-150}" $PY -m pytest -q -p no:cacheprovider tests/pdkernels/test_kernels_prefill_gpu.py \
        tests/engine/execution/test_engine_cuda_decode.py > "$OUT/kernel_tests.log" 2>&1
    say "prefill kernel + cuda decode tests: rc $? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/kernel_tests.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/kernel_tests.log" | head -20 | tee -a "$SUMMARY"
fi
if has engine; then
    # One process per model, each with its own budget, so a slow one cannot starve the other.
    for model in llama8b hybrid8b; do
        t0=$(date +%s)
        timeout "${ENGINE_S:-170}" $PY bench/micro/engine_speed.py --models "$model" --modes "$MODES" --batches '' \
            --contexts '' --prefill "$PREFILL" --hf --no-hf-compile --hicache-gb 0 --prefill-reps 2 --chunk 8192 \
            --time-budget-s "${BUDGET_S:-150}" --out "$OUT" --tag "sdpa_$model" \
            ${MIN_PAIRS:+--prefill-sdpa-min-pairs "$MIN_PAIRS"} > "$OUT/engine_speed_$model.log" 2>&1
        say "engine bench $model: rc $? $(( $(date +%s) - t0 )) s"
        grep -E "^ceilings" "$OUT/engine_speed_$model.log" | tail -1 | tee -a "$SUMMARY"
    done
    files=("$OUT"/engine_speed_sdpa_*.json)
    [[ -e "${files[0]}" ]] && $PY bench/micro/engine_speed.py --merge "${files[@]}" | grep -v "^ceilings" | tee -a "$SUMMARY"
fi
echo "==== summary"
cat "$SUMMARY"
