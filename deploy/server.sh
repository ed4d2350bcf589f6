#!/usr/bin/env bash
# The single-engine OpenAI-compatible server (colocated prefill and decode).
#
#   deploy/server.sh start [--model M] [--dp N] [--port P] [--host H] [any `python -m pd.server` flag]
#   deploy/server.sh stop [--port P]      # default: every server started from this run directory
#   deploy/server.sh status [--port P]
#
# start runs the server in its own process group (engine ranks included), logs to
# $RUN_DIR/server-PORT.log, writes $RUN_DIR/server-PORT.pid, waits until /health/ready says it serves
# and prints the URL. A server that already runs is left alone, unless a rank of it is down for good
# (its restart limit reached) or it does not answer /health: then start stops it and starts it anew.
# stop sends SIGTERM to the server: it stops admitting requests, lets those in flight finish (up to
# --shutdown-timeout, 30 s), stops its engine ranks and exits; whatever of its process group is left
# after $PDSERVE_STOP_TIMEOUT_S (45 s) gets SIGKILL, so no engine process survives holding memory.
# A pid file is trusted only while it names a live pd.server of this user: one naming another process
# is reported and never signalled (stop exits 1), one naming nothing is removed.
# RUN_DIR is $PDSERVE_RUN_DIR, or run/ in the repository.
set -euo pipefail

# shellcheck source=deploy/lib.sh
. "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

die() { echo "server.sh: $*" >&2; exit 1; }

usage() {  # the comment at the top of this file
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
    exit "${1:-0}"
}

pid_files() {  # pid_files [PORT]
    if [ -n "${1:-}" ]; then
        [ -f "$RUN_DIR/server-$1.pid" ] && echo "$RUN_DIR/server-$1.pid"
    else
        compgen -G "$RUN_DIR/server-*.pid" || true
    fi
}

cmd_start() {
    local port=8888 host=127.0.0.1 model=smollm2-135m-instruct args=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --port) port="${2:?--port needs a value}"; shift 2 ;;
            --port=*) port="${1#*=}"; shift ;;
            --host) host="${2:?--host needs a value}"; shift 2 ;;
            --host=*) host="${1#*=}"; shift ;;
            --model) model="${2:?--model needs a value}"; shift 2 ;;
            --model=*) model="${1#*=}"; shift ;;
            -h|--help) usage 0 ;;
            *) args+=("$1"); shift ;;
        esac
    done
    local pidfile="$RUN_DIR/server-$port.pid"
    local show_host="$host"
    [ "$host" = "0.0.0.0" ] && show_host=127.0.0.1
    local url="http://$show_host:$port"
    if keep_running pdserve "$port" "$pidfile" "$url"; then
        echo "pdserve is already running on port $port (pid $PIDFILE_PID): $url/v1"
        return 0
    fi
    start_server pdserve "$pidfile" "$url" -- --model "$model" --host "$host" --port "$port" ${args[@]+"${args[@]}"}
    echo "pdserve is ready: $url/v1 (model $model)"
    echo "stop it with: deploy/server.sh stop"
}

cmd_stop() {
    local port=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --port) port="${2:?--port needs a value}"; shift 2 ;;
            --port=*) port="${1#*=}"; shift ;;
            -h|--help) usage 0 ;;
            *) die "stop: unknown argument $1" ;;
        esac
    done
    local files
    files="$(pid_files "$port")"
    if [ -z "$files" ]; then
        echo "no pdserve server is running${port:+ on port $port} (no pid file in $RUN_DIR)"
        return 0
    fi
    local f rc=0
    for f in $files; do stop_pidfile "$f" || rc=1; done
    return "$rc"
}

cmd_status() {
    local port=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --port) port="${2:?--port needs a value}"; shift 2 ;;
            --port=*) port="${1#*=}"; shift ;;
            -h|--help) usage 0 ;;
            *) die "status: unknown argument $1" ;;
        esac
    done
    local files any=0
    files="$(pid_files "$port")"
    # shellcheck disable=SC2086
    status_pidfiles pdserve server- $files || any=1
    if [ "$any" -ne 0 ]; then
        echo "no pdserve server is running${port:+ on port $port}"
        return 3
    fi
}

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) shift; cmd_stop "$@" ;;
    status) shift; cmd_status "$@" ;;
    -h|--help|help) usage 0 ;;
    *) usage 2 >&2 ;;
esac
