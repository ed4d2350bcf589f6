#!/usr/bin/env bash
# The single-engine OpenAI-compatible server (colocated prefill and decode).
#
#   deploy/server.sh start [--model M] [--dp N] [--port P] [--host H] [any `python -m pd.server` flag]
#   deploy/server.sh stop [--port P]      # default: every server started from this run directory
#   deploy/server.sh status [--port P]
#
# start runs the server in its own process group (engine ranks included), logs to
# $RUN_DIR/server-PORT.log, writes $RUN_DIR/server-PORT.pid, waits until /health is ready and prints
# the URL. stop ends the whole group, so no engine process survives holding memory.
# RUN_DIR is $PDSERVE_RUN_DIR, or run/ in the repository.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${PDSERVE_RUN_DIR:-$ROOT/run}"
PY="${PDSERVE_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
START_TIMEOUT_S="${PDSERVE_START_TIMEOUT_S:-900}"

die() { echo "server.sh: $*" >&2; exit 1; }

usage() {
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

group_alive() { kill -0 -- "-$1" 2>/dev/null; }

healthy() {  # healthy URL: /health answers 200
    "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=3)' "$1" 2>/dev/null
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
    local pidfile="$RUN_DIR/server-$port.pid" log="$RUN_DIR/server-$port.log"
    local show_host="$host"
    [ "$host" = "0.0.0.0" ] && show_host=127.0.0.1
    local url="http://$show_host:$port"
    if [ -f "$pidfile" ] && alive "$(cat "$pidfile")"; then
        echo "pdserve is already running on port $port (pid $(cat "$pidfile")): $url/v1"
        return 0
    fi
    mkdir -p "$RUN_DIR"
    # os.setsid() then exec: the server leads a new process group that its engine ranks join.
    "$PY" -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' \
        "$PY" -m pd.server --model "$model" --host "$host" --port "$port" ${args[@]+"${args[@]}"} \
        >"$log" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$pidfile"
    echo "$url" >"$RUN_DIR/server-$port.url"
    echo "starting pdserve ($model) on $url, pid $pid, log $log ..."
    local waited=0
    until healthy "$url"; do
        if ! alive "$pid"; then
            rm -f "$pidfile"
            echo "pdserve failed to start; the end of $log:" >&2
            tail -n 30 "$log" >&2
            exit 1
        fi
        if [ "$waited" -ge "$START_TIMEOUT_S" ]; then
            echo "pdserve not ready after ${START_TIMEOUT_S}s; stopping it (log: $log)" >&2
            stop_one "$pidfile"
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    echo "pdserve is ready: $url/v1 (model $model)"
    echo "stop it with: deploy/server.sh stop"
}

stop_one() {  # stop_one PIDFILE
    local pidfile="$1" pid
    pid="$(cat "$pidfile")"
    if group_alive "$pid"; then
        kill -TERM -- "-$pid" 2>/dev/null || true
        local i
        for i in $(seq 1 60); do
            group_alive "$pid" || break
            sleep 0.5
        done
        if group_alive "$pid"; then
            echo "process group $pid did not exit after SIGTERM; killing it"
            kill -KILL -- "-$pid" 2>/dev/null || true
            sleep 0.5
        fi
        echo "stopped pdserve (process group $pid, $(basename "$pidfile" .pid))"
    else
        echo "not running: $(basename "$pidfile" .pid) (removed stale pid file)"
    fi
    rm -f "$pidfile" "${pidfile%.pid}.url"
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
    local f
    for f in $files; do stop_one "$f"; done
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
    local files f pid p url any=1
    files="$(pid_files "$port")"
    for f in $files; do
        pid="$(cat "$f")"
        p="${f##*/server-}"
        p="${p%.pid}"
        url="$(cat "$RUN_DIR/server-$p.url" 2>/dev/null || echo "http://127.0.0.1:$p")"
        if alive "$pid"; then
            any=0
            echo "running: $url/v1, pid $pid, log $RUN_DIR/server-$p.log"
            "$PY" -c 'import sys, urllib.request, urllib.error
try:
    print("  health:", urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())
except urllib.error.HTTPError as e:
    print("  health:", e.code, e.read().decode())
except OSError as e:
    print("  health: no answer:", e)' "$url/health"
        else
            echo "not running: port $p (stale pid file removed)"
            rm -f "$f" "${f%.pid}.url"
        fi
    done
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
