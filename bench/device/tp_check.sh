#!/usr/bin/env bash
# Tensor parallelism on a machine with two or more GPUs, one device call (run it only where `status` lends
# such a kind: nvidia-h100-x2 / nvidia-h200-x2 or larger):
#   1. bench/micro/tp_speed.py: llama8b decode b=1 and b=64 (1k context) at --tp 1 (CUDA graphs, as users
#      get it), at --tp 1 eager, and at --tp 2 (NCCL, eager: collectives are not captured in graphs yet), in
#      the same call; the summary gives --tp 2's batch-1 tokens/s over --tp 1's against the bar (>= 1.6x).
#   2. tests/pd/disagg/test_pair_tp.py on the GPUs (its servers take CUDA when there is one): the P/D pairs
#      PE --tp 1 -> CE --tp 2, 2 -> 1, 2 -> 2 through bench/check_pd.py, the re-sharding on NCCL.
# Rehearsed on the CPU with `TINY=1 bash bench/device/tp_check.sh` (gloo, toy dims).
#   OUT=... bash bench/device/tp_check.sh
set -u
OUT=${OUT:-/tmp/tp_check}
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
EXTRA=$([ -n "${TINY:-}" ] && echo "--tiny --batches 1,4")
for run in "1" "1 --enforce-eager" "2"; do
    set -- $run
    tag="tp$1${2:+_eager}"
    # shellcheck disable=SC2086  # EXTRA and run hold several arguments
    timeout -k 10 "${ROW_S:-150}" $PY bench/micro/tp_speed.py --tp $run $EXTRA --out "$OUT/$tag.json" \
        > "$OUT/$tag.log" 2>&1
    say "tp_speed --tp $run: rc $?"
    grep -E "^(#|tp )" "$OUT/$tag.log" | tee -a "$SUMMARY"
done
$PY - "$OUT" <<'PY' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def rows(tag):
    f = out / f"{tag}.json"
    return {r["batch"]: r for r in json.loads(f.read_text())} if f.exists() else {}
one, eager, two = rows("tp1"), rows("tp1_eager"), rows("tp2")
for b in sorted(two):
    t2 = two[b].get("tokens_per_s")
    for name, base in (("--tp 1 (graphs)", one), ("--tp 1 eager", eager)):
        t1 = base.get(b, {}).get("tokens_per_s")
        if t1 and t2:
            bar = " (bar >= 1.6x: " + ("met" if t2 / t1 >= 1.6 else "missed") + ")" if b == 1 else ""
            print(f"decode b={b}: --tp 2 {t2:,.1f} tok/s = {t2 / t1:.2f}x {name} {t1:,.1f}{bar}")
PY
if [ -z "${TINY:-}" ]; then
    t0=$(date +%s)
    timeout -k 10 "${PAIRS_S:-300}" $PY -m pytest -q -p no:cacheprovider tests/pd/disagg/test_pair_tp.py \
        > "$OUT/pairs.log" 2>&1
    say "P/D pairs across TP sizes on the GPUs: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/pairs.log")"
fi
