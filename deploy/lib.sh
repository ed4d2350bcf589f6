# Shared by deploy/server.sh and deploy/pd_run.sh (sourced, not run): paths, liveness checks, and
# starting/stopping one server in its own process group with a pid file beside its log.
# shellcheck shell=bash

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${PDSERVE_RUN_DIR:-$ROOT/run}"
PY="${PDSERVE_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
START_TIMEOUT_S="${PDSERVE_START_TIMEOUT_S:-900}"

# A zombie (exited, not reaped: its parent, an earlier script run, is gone) counts as dead.
alive() {
    [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" != "Z" ]
}

group_alive() {  # group_alive PGID: a live (non-zombie) process is in the group
    ps -eo pgid=,stat= 2>/dev/null | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}

healthy() {  # healthy URL: /health answers 200
    "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=3)' "$1" 2>/dev/null
}

print_health() {  # print_health URL: one line with /health's answer, whatever it is
    "$PY" -c 'import sys, urllib.request, urllib.error
try:
    print("  health:", urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())
except urllib.error.HTTPError as e:
    print("  health:", e.code, e.read().decode())
except OSError as e:
    print("  health: no answer:", e)' "$1/health"
}

# start_server NAME PIDFILE URL -- ARGS...: runs `python -m pd.server ARGS` as the leader of a new
# process group (its engine ranks join it), logs to PIDFILE's .log, waits until URL/health is ready.
# Exits 1 (stopping what it started) if the server dies or is not ready within START_TIMEOUT_S.
start_server() {
    local name="$1" pidfile="$2" url="$3"; shift 4
    local base="${pidfile%.pid}"
    local log="$base.log"
    mkdir -p "$RUN_DIR"
    "$PY" -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' \
        "$PY" -m pd.server "$@" >"$log" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$pidfile"
    echo "$url" >"$base.url"
    echo "starting $name on $url, pid $pid, log $log ..."
    local waited=0
    until healthy "$url"; do
        if ! alive "$pid"; then
            rm -f "$pidfile" "$base.url"
            echo "$name failed to start; the end of $log:" >&2
            tail -n 30 "$log" >&2
            exit 1
        fi
        if [ "$waited" -ge "$START_TIMEOUT_S" ]; then
            echo "$name is not ready after ${START_TIMEOUT_S}s; stopping it (log: $log)" >&2
            stop_pidfile "$pidfile"
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
}

stop_pidfile() {  # stop_pidfile PIDFILE: SIGTERM to the whole group, SIGKILL after 30 s
    local pidfile="$1" pid name
    pid="$(cat "$pidfile")"
    name="$(basename "$pidfile" .pid)"
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
        # Give the parent a moment to reap them: a caller checking the group right after sees it gone.
        for i in $(seq 1 20); do
            kill -0 -- "-$pid" 2>/dev/null || break
            sleep 0.1
        done
        echo "stopped $name (process group $pid)"
    else
        echo "not running: $name (removed stale pid file)"
    fi
    rm -f "$pidfile" "${pidfile%.pid}.url"
}

# status_pidfiles LABEL PREFIX FILES...: a line (and /health) per pid file; returns 3 when none runs
status_pidfiles() {
    local label="$1" prefix="$2"; shift 2
    local f pid p url any=1
    for f in "$@"; do
        pid="$(cat "$f")"
        p="${f##*/"$prefix"}"
        p="${p%.pid}"
        url="$(cat "${f%.pid}.url" 2>/dev/null || echo "http://127.0.0.1:$p")"
        if alive "$pid"; then
            any=0
            echo "$label running: $url, pid $pid, log ${f%.pid}.log"
            print_health "$url"
        else
            echo "$label not running: port $p (stale pid file removed)"
            rm -f "$f" "${f%.pid}.url"
        fi
    done
    return "$any"
}
