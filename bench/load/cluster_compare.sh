#!/usr/bin/env bash
# PE choice in a P/D cluster, on one machine (loopback addresses stand for hosts): the same multi-turn
# trace against three clusters, each behind two CEs (127.0.0.4, 127.0.0.5; a conversation's turns
# alternate between them, as behind a load balancer that does not keep sessions):
#   one-pe        1 PE (127.0.0.2)
#   affinity      2 PEs (127.0.0.2, 127.0.0.3), --pe-routing affinity (the default)
#   least-loaded  the same 2 PEs, --pe-routing least-loaded
# The PEs are shared (runs never overlap, and each run's conversations start with their own marker, so
# no run hits another's cache); each configuration has its own CEs on its own port.
#
#   bench/load/cluster_compare.sh OUT_DIR [bench/load/compare.py flags, e.g. --concurrency 4 --duration-s 120]
#
# Starts everything with deploy/pd_run.sh (RUN_DIR: OUT_DIR/run), runs bench/load/compare.py --interleave,
# stops everything. SERVER_FLAGS (environment) go to every server.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: bench/load/cluster_compare.sh OUT_DIR [compare.py flags]}"; shift
mkdir -p "$OUT"
export PDSERVE_RUN_DIR="$OUT/run"
PY="${PDSERVE_PYTHON:-$ROOT/.venv/bin/python}"
read -r -a FLAGS <<<"${SERVER_FLAGS:---max-model-len 4096 --kv-cache-gb 0.6 --hicache-gb 0.5}"
PES=127.0.0.2,127.0.0.3
CES=127.0.0.4,127.0.0.5
PE_PORT=18889

stop_all() {
    "$ROOT/deploy/pd_run.sh" stop "$PES" "$CES" || true
}
trap stop_all EXIT

start() {  # start PE_HOSTS CE_PORT KV_BASE [flags]
    local pes="$1" port="$2" kv="$3"; shift 3
    "$ROOT/deploy/pd_run.sh" start "$pes" "$CES" --port "$port" --pe-port "$PE_PORT" --kv-port-base "$kv" \
        "${FLAGS[@]}" "$@"
}
start "$PES" 18801 18900                               # affinity
start "$PES" 18802 18910 --pe-routing least-loaded     # least-loaded
start 127.0.0.2 18803 18920                            # one-pe
"$ROOT/deploy/pd_run.sh" status "$PES" "$CES"

ces() { echo "http://127.0.0.4:$1,http://127.0.0.5:$1"; }
"$PY" "$ROOT/bench/load/compare.py" --interleave \
    --target "one-pe=$(ces 18803)" --target "affinity=$(ces 18801)" --target "least-loaded=$(ces 18802)" \
    --out "$OUT" "$@"
for port in 18803 18801 18802; do  # where each configuration's prefills went, per PE and reason
    for ce in 127.0.0.4 127.0.0.5; do
        echo "== CE $ce:$port"
        curl -s "http://$ce:$port/metrics" | grep '^pdserve_pe_selected_total' | grep -v ' 0.0$' || true
    done
done | tee "$OUT/pe_selected.txt"
