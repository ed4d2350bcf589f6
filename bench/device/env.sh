# Sourced by the one-call device scripts (bench/device/boundary_check.sh, bench/device/moe_check.sh) after they set
# OUT's default: the wheels carried in .whl/ installed into /tmp/site (never into the image) and put on
# PYTHONPATH with the repo, $PY, a fresh $OUT/summary.txt, and `say` (a line to the screen and to the
# summary), whose first two lines give the GPU and the versions.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
say "$(date -u '+%Y-%m-%d %H:%M UTC') $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
say "$($PY -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)')"
