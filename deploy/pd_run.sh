#!/usr/bin/env bash
# The P/D pair: a prefill engine (PE) on one host, a decode engine + OpenAI coordinator (CE) on another.
#
#   deploy/pd_run.sh start <pe-host> <ce-host> [--port P] [--pe-port P] [--kv-port-base P] [server flags]
#   deploy/pd_run.sh stop <pe-host> <ce-host> [--port P] [--pe-port P]
#   deploy/pd_run.sh status [<pe-host> <ce-host>] [--port P] [--pe-port P]
#
# start runs `python -m pd.server --role pe` on pe-host (POST /prefill on --pe-port, 8889) and
# `--role ce` on ce-host (OpenAI API on --port, 8888; KV receivers on --kv-port-base + rank, 8900+),
# each in its own process group, waits for both /health and prints the endpoint. It starts only what
# is not running: after a PE crash, running it again brings the PE back and leaves the CE alone.
# Server flags (--model, --dp, --deterministic, --max-model-len, ...) go to both sides.
# stop ends both process groups (SIGTERM, then SIGKILL): no engine survives on either host.
#
# Hosts: localhost or 127.x runs there locally; any other host through ssh, with the repository at the
# same path. A remote PE binds pe-host (the CE's coordinator reaches it there); a remote CE binds its KV
# receivers to ce-host. Locally everything binds 127.0.0.1, so the hosts are both local or both remote.
# Cluster token: $PDSERVE_CLUSTER_TOKEN or $PDSERVE_CLUSTER_TOKEN_FILE if set, else RUN_DIR/cluster.token
# (made once, mode 600, copied to a remote host's RUN_DIR). Logs and pid files: RUN_DIR (default run/,
# or $PDSERVE_RUN_DIR) as pd-pe-PORT.{log,pid} and pd-ce-PORT.{log,pid}; deploy/server.sh's
# server-PORT.* files are another name space, so a single-engine server runs beside the pair.
set -euo pipefail

# shellcheck source=deploy/lib.sh
. "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
SELF="$ROOT/deploy/pd_run.sh"

die() { echo "pd_run.sh: $*" >&2; exit 1; }

usage() {
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

is_local() { case "$1" in localhost|127.*|::1) return 0 ;; *) return 1 ;; esac; }

# on HOST CMD...: runs this script's internal command CMD on HOST (here, or through ssh).
on() {
    local host="$1"; shift
    if is_local "$host"; then
        "$SELF" "$@"
    else
        local q="" a
        for a in "$@"; do q+=" $(printf '%q' "$a")"; done
        # shellcheck disable=SC2029
        ssh -o BatchMode=yes "$host" "PDSERVE_RUN_DIR=$(printf '%q' "$RUN_DIR") $(printf '%q' "$SELF")$q"
    fi
}

# ---- internal commands (run on the host they concern) ----------------------------------------------

# _start ROLE PORT URL [server flags]: starts one side unless it runs; waits for /health.
internal_start() {
    local role="$1" port="$2" url="$3"; shift 3
    local pidfile="$RUN_DIR/pd-$role-$port.pid"
    if [ -f "$pidfile" ] && alive "$(cat "$pidfile")"; then
        echo "$role already running on port $port (pid $(cat "$pidfile")): $url"
        return 0
    fi
    start_server "the $role" "$pidfile" "$url" -- --role "$role" --port "$port" "$@"
    echo "$role ready: $url"
}

pidfiles() {  # pidfiles ROLE [PORT]: one a line (RUN_DIR may hold spaces: read them with mapfile)
    if [ -n "${2:-}" ]; then
        [ -f "$RUN_DIR/pd-$1-$2.pid" ] && echo "$RUN_DIR/pd-$1-$2.pid"
    else
        compgen -G "$RUN_DIR/pd-$1-*.pid" || true
    fi
    return 0
}

# _stop ROLE [PORT]
internal_stop() {
    local -a files; local f
    mapfile -t files < <(pidfiles "$1" "${2:-}")
    if [ "${#files[@]}" -eq 0 ]; then
        echo "no $1 running${2:+ on port $2} ($(hostname))"
        return 0
    fi
    for f in "${files[@]}"; do stop_pidfile "$f"; done
}

# _status ROLE [PORT]: exit 3 when nothing runs
internal_status() {
    local -a files; local any=0
    mapfile -t files < <(pidfiles "$1" "${2:-}")
    status_pidfiles "$1" "pd-$1-" ${files[@]+"${files[@]}"} || any=1
    if [ "$any" -ne 0 ]; then
        echo "no $1 running${2:+ on port $2} ($(hostname))"
        return 3
    fi
}

# _token_file: prints the path of RUN_DIR/cluster.token, making it if missing (from stdin if given)
internal_token() {
    mkdir -p "$RUN_DIR"
    local f="$RUN_DIR/cluster.token"
    if [ "${1:-}" = "--from-stdin" ]; then
        (umask 077 && cat >"$f.tmp" && mv "$f.tmp" "$f")
    elif [ ! -s "$f" ]; then
        (umask 077 && "$PY" -m transfer.auth >"$f")
    fi
    echo "$f"
}

# ---- user commands ---------------------------------------------------------------------------------

parse_ports() {  # sets CE_PORT PE_PORT KV_BASE ARGS from "$@"
    CE_PORT=8888 PE_PORT=8889 KV_BASE=8900 CE_HOST_BIND=127.0.0.1 ARGS=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --port) CE_PORT="${2:?--port needs a value}"; shift 2 ;;
            --port=*) CE_PORT="${1#*=}"; shift ;;
            --pe-port) PE_PORT="${2:?--pe-port needs a value}"; shift 2 ;;
            --pe-port=*) PE_PORT="${1#*=}"; shift ;;
            --kv-port-base) KV_BASE="${2:?--kv-port-base needs a value}"; shift 2 ;;
            --kv-port-base=*) KV_BASE="${1#*=}"; shift ;;
            --host) CE_HOST_BIND="${2:?--host needs a value}"; shift 2 ;;
            --host=*) CE_HOST_BIND="${1#*=}"; shift ;;
            --role|--role=*|--prefill-url|--prefill-url=*|--kv-host|--kv-host=*)
                die "$1 is set by pd_run.sh itself" ;;
            -h|--help) usage 0 ;;
            *) ARGS+=("$1"); shift ;;
        esac
    done
}

cmd_start() {
    [ $# -ge 2 ] || usage 2 >&2
    local pe_host="$1" ce_host="$2"; shift 2
    parse_ports "$@"
    # A side bound to 127.0.0.1 is out of the other host's reach (it would dial its own loopback).
    local pe_local=0 ce_local=0
    is_local "$pe_host" && pe_local=1
    is_local "$ce_host" && ce_local=1
    [ "$pe_local" = "$ce_local" ] || die "start $pe_host $ce_host: one side on loopback, one remote;" \
        "name this host by an address the other host reaches (it is then started through ssh)"
    local pe_bind=127.0.0.1 kv_bind=127.0.0.1
    is_local "$pe_host" || pe_bind="$pe_host"
    is_local "$ce_host" || kv_bind="$ce_host"
    local token_args=()
    if [ -z "${PDSERVE_CLUSTER_TOKEN:-}" ] && [ -z "${PDSERVE_CLUSTER_TOKEN_FILE:-}" ]; then
        local tf
        tf="$(internal_token)"
        local h
        for h in "$pe_host" "$ce_host"; do
            is_local "$h" || on "$h" _token --from-stdin <"$tf" >/dev/null
        done
        token_args=(--cluster-token-file "$tf")
    fi
    local pe_url="http://$pe_bind:$PE_PORT"
    local show_host="$CE_HOST_BIND"
    [ "$show_host" = "0.0.0.0" ] && show_host="$ce_host"
    is_local "$show_host" && show_host=127.0.0.1
    local ce_url="http://$show_host:$CE_PORT"
    on "$pe_host" _start pe "$PE_PORT" "$pe_url" --host "$pe_bind" \
        ${token_args[@]+"${token_args[@]}"} ${ARGS[@]+"${ARGS[@]}"}
    on "$ce_host" _start ce "$CE_PORT" "$ce_url" --host "$CE_HOST_BIND" --prefill-url "$pe_url" \
        --kv-host "$kv_bind" --kv-port-base "$KV_BASE" ${token_args[@]+"${token_args[@]}"} ${ARGS[@]+"${ARGS[@]}"}
    echo "P/D pair ready: $ce_url/v1 (prefill on $pe_host:$PE_PORT, decode on $ce_host)"
    echo "stop it with: deploy/pd_run.sh stop $pe_host $ce_host"
}

parse_side_ports() {  # parse_side_ports COMMAND [--port P] [--pe-port P]: sets CE_PORT_ARG PE_PORT_ARG
    local cmd="$1"; shift
    while [ $# -gt 0 ]; do
        case "$1" in
            --port) CE_PORT_ARG="${2:?}"; shift 2 ;;
            --pe-port) PE_PORT_ARG="${2:?}"; shift 2 ;;
            *) die "$cmd: unknown argument $1" ;;
        esac
    done
}

cmd_stop() {
    [ $# -ge 2 ] || usage 2 >&2
    local pe_host="$1" ce_host="$2"; shift 2
    local CE_PORT_ARG="" PE_PORT_ARG=""
    parse_side_ports stop "$@"
    # The CE first: its clients get an error rather than waiting on a PE that is gone.
    on "$ce_host" _stop ce "$CE_PORT_ARG"
    on "$pe_host" _stop pe "$PE_PORT_ARG"
}

cmd_status() {
    local pe_host=localhost ce_host=localhost
    if [ $# -ge 2 ] && [ "${1#-}" = "$1" ]; then pe_host="$1" ce_host="$2"; shift 2; fi
    local CE_PORT_ARG="" PE_PORT_ARG=""
    parse_side_ports status "$@"
    local rc=0
    on "$pe_host" _status pe "$PE_PORT_ARG" || rc=3
    on "$ce_host" _status ce "$CE_PORT_ARG" || rc=3
    return "$rc"
}

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) shift; cmd_stop "$@" ;;
    status) shift; cmd_status "$@" ;;
    _start) shift; internal_start "$@" ;;
    _stop) shift; internal_stop "$@" ;;
    _status) shift; internal_status "$@" ;;
    _token) shift; internal_token "$@" ;;
    -h|--help|help) usage 0 ;;
    *) usage 2 >&2 ;;
esac
