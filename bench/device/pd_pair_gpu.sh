#!/usr/bin/env bash
# The P/D pair on one GPU machine (issue 6's GPU checks, issue 7's GPU load run): bench/device/pd_pair_gpu.py
# after making its Python ready. The GPU machine's image lacks a few packages the servers and checks
# import (pyzmq, orjson, openai and its pydantic, gguf for the conversion): when they
# are missing, wheels carried in .whl/ are installed into /tmp/site (never into the image) first.
#
#   bench/device/pd_pair_gpu.sh --out "$OUT" --gguf .dev/stage1/smollm2.gguf.part1+.dev/stage2/smollm2.gguf.part2
#   bench/device/pd_pair_gpu.sh --out /tmp/pd --steps tests,handoff          # the transports alone
#
# Every flag goes to bench/device/pd_pair_gpu.py (--help lists them); PDSERVE_PYTHON picks the interpreter.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PDSERVE_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1

if ! "$PY" -c 'import zmq, orjson, openai, gguf' 2>/dev/null; then
    if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$ROOT"/.whl/*.whl
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c 'import zmq, orjson, msgpack, aiohttp' || { echo "pd_pair_gpu.sh: the servers' packages are missing" >&2; exit 2; }
    "$PY" -c 'import openai, gguf' || echo "pd_pair_gpu.sh: no openai/gguf: check_pd or the conversion will fail" >&2
fi

cd "$ROOT"
exec "$PY" bench/device/pd_pair_gpu.py "$@"
