# Shared by deploy/server.sh and deploy/pd_run.sh (sourced, not run): paths, liveness checks, and
# starting, repairing and stopping one server in its own process group with a pid file beside its log.
#
# A pid file is trusted only while it names a live process of this user that runs pd.server (what
# start_server wrote). Nothing else is ever signalled: a file without a positive integer, or whose process
# is gone, is stale and removed; one naming another process (another user's, or a pid the system gave to
# another program since) is reported and left as it is, for the user to look at.
# shellcheck shell=bash

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${PDSERVE_RUN_DIR:-$ROOT/run}"
PY="${PDSERVE_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
START_TIMEOUT_S="${PDSERVE_START_TIMEOUT_S:-900}"
# The server's drain (--shutdown-timeout, 30 s by default) and the time to stop its ranks after it.
STOP_TIMEOUT_S="${PDSERVE_STOP_TIMEOUT_S:-45}"
case "$STOP_TIMEOUT_S" in
    "" | *[!0-9]*) echo "PDSERVE_STOP_TIMEOUT_S must be whole seconds, not '$STOP_TIMEOUT_S'" >&2; exit 2 ;;
esac

# A zombie (exited, not reaped: its parent, an earlier script run, is gone) counts as dead; another
# user's process (which kill -0 could not probe) as alive.
alive() {
    local stat
    [ -n "${1:-}" ] && stat="$(ps -o stat= -p "$1" 2>/dev/null)" && [ -n "$stat" ] && [ "${stat:0:1}" != Z ]
}

group_alive() {  # group_alive PGID: a live (non-zombie) process is in the group
    ps -eo pgid=,stat= 2>/dev/null | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}

group_has_others() {  # group_has_others PGID: a process of another user is in the group
    ps -eo pgid=,uid= 2>/dev/null | awk -v g="$1" -v u="$(id -u)" '$1 == g && $2 != u { found = 1 } END { exit !found }'
}

runs_as_me() {  # runs_as_me PID: the process's real uid is this user's
    [ "$(awk '/^Uid:/ { print $2 }' "/proc/$1/status" 2>/dev/null)" = "$(id -u)" ]
}

runs_module() {  # runs_module PID MODULE: this user's process with MODULE for an argument (python -m MODULE)
    local args
    runs_as_me "$1" || return 1
    args="$(tr '\0' '\n' 2>/dev/null <"/proc/$1/cmdline")" || return 1
    grep -qxF -- "$2" <<<"$args"
}

# pidfile_check PIDFILE: sets PIDFILE_PID (the file's content) and PIDFILE_STATE, one of
#   ours     a live process of this user running pd.server
#   stale    a pid whose process is gone (a zombie counts as gone)
#   garbage  not a positive integer (empty, cut short, overwritten)
#   foreign  a live process that is not ours: never signalled
pidfile_check() {
    PIDFILE_PID="$(head -c 64 "$1" 2>/dev/null || true)"
    if ! [[ "$PIDFILE_PID" =~ ^[1-9][0-9]{0,9}$ ]]; then
        PIDFILE_STATE=garbage
    elif runs_module "$PIDFILE_PID" pd.server && alive "$PIDFILE_PID"; then
        PIDFILE_STATE=ours
    elif alive "$PIDFILE_PID"; then
        PIDFILE_STATE=foreign
    else
        PIDFILE_STATE=stale
    fi
}

foreign_pidfile() {  # foreign_pidfile PIDFILE: why pidfile_check's foreign PIDFILE is left alone
    local who
    who="$(ps -o user=,args= -p "$PIDFILE_PID" 2>/dev/null | cut -c1-100)"
    echo "$1 holds pid $PIDFILE_PID, which is not a pdserve server of this user (${who:-unknown});" \
        "nothing was signalled: remove the file if that server is gone"
}

remove_pidfile() {  # remove_pidfile PIDFILE: the pid file and its .url
    rm -f "$1" "${1%.pid}.url"
}

ready() {  # ready URL: /health/ready answers 200 (a server without it: /health answers 200)
    "$PY" -c 'import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1] + "/health/ready", timeout=3)
except urllib.error.HTTPError as e:
    if e.code != 404:
        sys.exit(1)
    urllib.request.urlopen(sys.argv[1] + "/health", timeout=3)' "$1" 2>/dev/null
}

# rank_states URL: prints the state of each rank from /health (up, starting, restarting, down, stopped)
# on one line; fails when /health gives no JSON answer in 3 tries (a 503 with a body is an answer).
rank_states() {
    "$PY" -c 'import json, sys, time, urllib.error, urllib.request
for attempt in range(3):
    try:
        body = urllib.request.urlopen(sys.argv[1] + "/health", timeout=5).read()
    except urllib.error.HTTPError as e:
        body = e.read()
    except OSError:
        time.sleep(1)
        continue
    print(" ".join(str(r["state"]) for r in json.loads(body)["ranks"]))
    sys.exit(0)
sys.exit(1)' "$1" 2>/dev/null
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

# launch_server NAME PIDFILE URL -- ARGS...: runs `python -m pd.server ARGS` as the leader of a new
# process group (its engine ranks join it), logging to PIDFILE's .log, and returns (wait_server waits).
launch_server() {
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
}

# wait_server NAME PIDFILE URL: waits until URL/health/ready says the server PIDFILE names serves. Exits 1
# (stopping it) if it dies or is not ready within START_TIMEOUT_S.
wait_server() {
    local name="$1" pidfile="$2" url="$3"
    local log="${pidfile%.pid}.log" pid deadline=$((SECONDS + START_TIMEOUT_S))
    pid="$(head -c 64 "$pidfile" 2>/dev/null || true)"
    until ready "$url"; do
        if ! alive "$pid"; then
            remove_pidfile "$pidfile"
            echo "$name failed to start; the end of $log:" >&2
            tail -n 30 "$log" >&2
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "$name is not ready after ${START_TIMEOUT_S}s; stopping it (log: $log)" >&2
            stop_pidfile "$pidfile" || true
            exit 1
        fi
        sleep 0.5
    done
}

# start_server NAME PIDFILE URL -- ARGS...: launch_server, then wait_server.
start_server() {
    launch_server "$@"
    wait_server "$1" "$2" "$3"
}

# keep_running LABEL PORT PIDFILE URL: whether start finds LABEL running as it should. 0: it runs with
# every rank up, starting or being restarted by the server itself. 1: it is to be started: there is no
# pid file, or a stale one (removed), or the server had a rank down for good (its restart limit reached)
# or did not answer /health, and was stopped here (saying why). Exits 1 on a pid file of another process.
keep_running() {
    local label="$1" port="$2" pidfile="$3" url="$4" states
    [ -f "$pidfile" ] || return 1
    pidfile_check "$pidfile"
    case "$PIDFILE_STATE" in
        foreign)
            echo "${0##*/}: not starting $label on port $port: $(foreign_pidfile "$pidfile")" >&2
            exit 1 ;;
        garbage | stale)
            stop_pidfile "$pidfile" || exit 1  # the file goes, and any engine rank its server left behind
            return 1 ;;
    esac
    if ! states="$(rank_states "$url")"; then
        echo "$label on port $port (pid $PIDFILE_PID) does not answer $url/health; restarting it"
    elif [[ " $states " == *" down "* ]]; then
        echo "$label on port $port has rank(s) down for good; restarting it"
    else
        return 0
    fi
    stop_pidfile "$pidfile" || exit 1
    return 1
}

# stop_pidfile PIDFILE: stops the server it names. SIGTERM goes to the server alone (its engine ranks
# ignore it): the server stops admitting requests, lets those in flight finish (--shutdown-timeout,
# 30 s), stops its ranks and exits. What is left of its process group after STOP_TIMEOUT_S gets SIGKILL.
# Returns 1, having signalled nothing, when the pid file names a process that is not ours.
stop_pidfile() {
    local pidfile="$1" name pid
    name="$(basename "$pidfile" .pid)"
    pidfile_check "$pidfile"
    pid="$PIDFILE_PID"
    case "$PIDFILE_STATE" in
        foreign)
            echo "${0##*/}: not stopping $name: $(foreign_pidfile "$pidfile")" >&2
            return 1 ;;
        garbage)
            echo "not running: $name ($pidfile held no pid; removed it)"
            remove_pidfile "$pidfile"
            return 0 ;;
        stale)
            if ! group_alive "$pid"; then
                echo "not running: $name (removed stale pid file)"
                remove_pidfile "$pidfile"
                return 0
            fi
            # NOTE: a group id is not reused while the group lives: these are the dead server's processes.
            if group_has_others "$pid"; then
                echo "${0##*/}: not stopping $name: process group $pid of its dead server holds" \
                    "another user's processes; nothing was signalled" >&2
                return 1
            fi
            echo "$name's server (pid $pid) is gone but processes of its group remain; killing them"
            kill -KILL -- "-$pid" 2>/dev/null || true ;;
        ours)
            echo "stopping $name (pid $pid): requests in flight finish first (up to ${STOP_TIMEOUT_S}s)"
            kill -TERM "$pid" 2>/dev/null || true
            local deadline=$((SECONDS + STOP_TIMEOUT_S))
            while group_alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do
                sleep 0.2
            done
            if group_alive "$pid"; then
                echo "$name did not exit within ${STOP_TIMEOUT_S}s of SIGTERM; killing its process group $pid"
                kill -KILL -- "-$pid" 2>/dev/null || true
            fi ;;
    esac
    # Give the parent a moment to reap them: a caller checking the group right after sees it gone.
    for _ in $(seq 1 20); do
        kill -0 -- "-$pid" 2>/dev/null || break
        sleep 0.1
    done
    echo "stopped $name (process group $pid)"
    remove_pidfile "$pidfile"
}

# status_pidfiles LABEL PREFIX FILES...: a line (and /health) per pid file; returns 3 when none runs
status_pidfiles() {
    local label="$1" prefix="$2"; shift 2
    local f p url any=1
    for f in "$@"; do
        p="${f##*/"$prefix"}"
        p="${p%.pid}"
        url="$(cat "${f%.pid}.url" 2>/dev/null || echo "http://127.0.0.1:$p")"
        pidfile_check "$f"
        case "$PIDFILE_STATE" in
            ours)
                any=0
                echo "$label running: $url, pid $PIDFILE_PID, log ${f%.pid}.log"
                print_health "$url" ;;
            foreign)
                echo "$label on port $p: foreign pid file: $(foreign_pidfile "$f")" ;;
            *)
                echo "$label not running: port $p (stale pid file removed)"
                remove_pidfile "$f" ;;
        esac
    done
    return "$any"
}
