#!/usr/bin/env bash
# The P/D cluster: prefill engines (PE) on some hosts, decode engines + OpenAI coordinators (CE) on others.
#
#   deploy/pd_run.sh start <pe-hosts> <ce-hosts> [--port P] [--pe-port P] [--kv-port-base P] [server flags]
#   deploy/pd_run.sh stop <pe-hosts> <ce-hosts> [--port P] [--pe-port P]
#   deploy/pd_run.sh status [<pe-hosts> <ce-hosts>] [--port P] [--pe-port P]
#
# Hosts are comma-separated lists (one host each for a pair). start runs `python -m pd.server --role pe`
# on every pe-host (POST /prefill on --pe-port, 8889) and `--role ce` on every ce-host (OpenAI API on
# --port, 8888; KV receivers on --kv-port-base + rank, 8900+), each in its own process group, all at once
# (the CEs load while the PEs do), waits for every /health/ready and for each CE to see every PE up, and
# prints the endpoints. Every CE is given every PE (--prefill-url a,b,...): it
# picks a conversation's PE by rendezvous hashing, the same choice on every CE, so put any HTTP load
# balancer in front of the CEs. start runs only what is not running as it should: after a crash, running
# it again brings that server back and leaves the others alone; a server with a rank down for good (its
# restart limit reached), or that does not answer /health, is stopped and started anew. Server flags
# (--model, --dp, --deterministic, --pe-routing, ...) go to every server.
# stop sends SIGTERM to each server (the CEs first): it stops admitting requests, lets those in flight
# finish (up to --shutdown-timeout, 30 s), stops its engine ranks and exits; whatever of its process
# group is left after $PDSERVE_STOP_TIMEOUT_S (45 s) gets SIGKILL: no engine survives anywhere.
# status prints one row per server: host, role, port, pid, rank states, health, requests in flight.
# A pid file is trusted only while it names a live pd.server of this user: one naming another process is
# reported and never signalled (stop exits 1), one naming nothing is removed.
#
# Hosts: localhost and 127.x.y.z run here: a 127.x.y.z server binds that address (so one machine stands
# in for several hosts: 127.0.0.2,127.0.0.3 are two PE hosts), localhost binds 127.0.0.1. Any other host
# is reached through ssh, with the repository at the same path (a host name starting with '-' is
# refused: ssh would read it as an option); its PE binds the host's name, its CE's KV receivers too
# (--host sets where a CE's OpenAI API binds, 127.0.0.1 by default there). Local and remote hosts do not
# mix (a loopback address is out of another host's reach).
# Cluster token: $PDSERVE_CLUSTER_TOKEN or $PDSERVE_CLUSTER_TOKEN_FILE if set, else RUN_DIR/cluster.token
# (made once, mode 600, copied to each remote host's RUN_DIR). A token file that group or others may
# read is refused, here and by the server (chmod 600 it). Logs and pid files: RUN_DIR (default run/, or
# $PDSERVE_RUN_DIR) as pd-pe-HOST-PORT.{log,pid} and pd-ce-HOST-PORT.{log,pid} (HOST: the address it
# binds); deploy/server.sh's server-PORT.* files are another name space, so a single-engine server runs
# beside the cluster.
set -euo pipefail

# shellcheck source=deploy/lib.sh
. "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
SELF="$ROOT/deploy/pd_run.sh"

die() { echo "pd_run.sh: $*" >&2; exit 1; }

usage() {  # the comment at the top of this file
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
    exit "${1:-0}"
}

is_local() { case "$1" in localhost|127.*|::1) return 0 ;; *) return 1 ;; esac; }

check_host() {  # check_host HOST: dies on a name ssh would take for an option (-oProxyCommand=...)
    case "$1" in
        "") die "empty host name" ;;
        -*) die "host name '$1' starts with '-': refused (ssh would read it as an option)" ;;
    esac
}

# on HOST CMD...: runs this script's internal command CMD on HOST (here, or through ssh).
on() {
    local host="$1"; shift
    check_host "$host"
    if is_local "$host"; then
        "$SELF" "$@"
    else
        local q="" a
        for a in "$@"; do q+=" $(printf '%q' "$a")"; done
        # shellcheck disable=SC2029
        ssh -o BatchMode=yes -- "$host" "PDSERVE_RUN_DIR=$(printf '%q' "$RUN_DIR") $(printf '%q' "$SELF")$q"
    fi
}

# ---- internal commands (run on the host they concern) ----------------------------------------------

# _start ROLE HOST PORT URL [server flags]: starts one server unless it runs as it should (keep_running);
# waits until it is ready. HOST (the host's address) names its files: pd-ROLE-HOST-PORT.*
internal_start() {
    internal_launch "$@"
    [ "$LAUNCHED" = 0 ] || internal_wait "$1" "$2" "$3" "$4"
}

# _launch ROLE HOST PORT URL [server flags]: _start without the wait (_wait waits); LAUNCHED=0 when it
# found the server running as it should
internal_launch() {
    local role="$1" bind="$2" port="$3" url="$4"; shift 4
    local pidfile="$RUN_DIR/pd-$role-$bind-$port.pid"
    LAUNCHED=0
    if keep_running "$role" "$port" "$pidfile" "$url"; then
        echo "$role already running on $bind:$port (pid $PIDFILE_PID): $url"
        return 0
    fi
    LAUNCHED=1
    launch_server "the $role on $bind" "$pidfile" "$url" -- --role "$role" --port "$port" "$@"
}

# _wait ROLE HOST PORT URL [NUM_PES]: waits until the server is ready; a CE (NUM_PES given) also until it
# sees that many PEs up, for up to PES_UP_TIMEOUT_S (it probes a PE that is down at most 2 s apart), so
# that every CE ranks a conversation's PEs alike from the first request on.
internal_wait() {
    local role="$1" bind="$2" port="$3" url="$4" num_pes="${5:-}"
    wait_server "the $role on $bind" "$RUN_DIR/pd-$role-$bind-$port.pid" "$url"
    if [ -n "$num_pes" ]; then
        local up deadline=$((SECONDS + PES_UP_TIMEOUT_S))
        until up="$(pes_up "$url")" && [ "$up" -ge "$num_pes" ]; do
            if [ "$SECONDS" -ge "$deadline" ]; then
                echo "$role on $bind sees ${up:-no} PE(s) up of $num_pes after ${PES_UP_TIMEOUT_S}s;" \
                    "it serves with those (deploy/pd_run.sh status shows which)"
                break
            fi
            sleep 0.25
        done
    fi
    echo "$role ready: $url"
}

PES_UP_TIMEOUT_S=30

pes_up() {  # pes_up URL: prints how many of the CE's PEs its /health says are up
    "$PY" -c 'import json, sys, urllib.error, urllib.request
try:
    body = urllib.request.urlopen(sys.argv[1] + "/health", timeout=3).read()
except urllib.error.HTTPError as e:
    body = e.read()
pes = json.loads(body).get("prefill_engines") or []
print(sum(p.get("state") == "up" for p in pes))' "$1" 2>/dev/null
}

pidfiles() {  # pidfiles ROLE [BIND [PORT]]: one a line (RUN_DIR may hold spaces: read them with mapfile)
    compgen -G "$RUN_DIR/pd-$1-${2:-*}-${3:-*}.pid" || true
}

# _stop ROLE BIND [PORT]: exit 1 when a pid file names a process that is not ours (left alone)
internal_stop() {
    local -a files; local f rc=0
    mapfile -t files < <(pidfiles "$1" "$2" "${3:-}")
    if [ "${#files[@]}" -eq 0 ]; then
        echo "no $1 running on $2${3:+:$3} ($(hostname))"
        return 0
    fi
    for f in "${files[@]}"; do stop_pidfile "$f" || rc=1; done
    return "$rc"
}

# server_row URL: "RANKS HEALTH INFLIGHT" from URL/health (ranks: their states, comma-separated)
server_row() {
    "$PY" -c 'import json, sys, urllib.error, urllib.request
try:
    body = urllib.request.urlopen(sys.argv[1] + "/health", timeout=3).read()
except urllib.error.HTTPError as e:
    body = e.read()
except OSError:
    print("- no-answer -")
    sys.exit(0)
try:
    h = json.loads(body)
    ranks = h.get("ranks") or []
    health = h["status"]
    pes = h.get("prefill_engines")
    if pes is not None:
        health += "(pe:%d/%d)" % (sum(p["state"] == "up" for p in pes), len(pes))
    print(",".join(r["state"] for r in ranks) or "-", health, sum(r.get("num_inflight", 0) for r in ranks))
except (ValueError, KeyError, TypeError):
    print("- bad-answer -")' "$1" 2>/dev/null
}

# _status ROLE BIND [PORT]: a row per server (BIND "*": every one here); exit 3 when none runs
internal_status() {
    local -a files; local f rest host port url any=3
    mapfile -t files < <(pidfiles "$1" "$2" "${3:-}")
    for f in ${files[@]+"${files[@]}"}; do
        rest="${f##*/pd-"$1"-}"
        rest="${rest%.pid}"
        host="${rest%-*}" port="${rest##*-}"
        url="$(cat "${f%.pid}.url" 2>/dev/null || echo "http://$host:$port")"
        pidfile_check "$f"
        case "$PIDFILE_STATE" in
            ours)
                any=0
                local ranks health inflight
                read -r ranks health inflight <<<"$(server_row "$url")"
                printf '%-16s %-4s %-6s %-8s %-12s %-16s %s\n' "$host" "$1" "$port" "$PIDFILE_PID" \
                    "$ranks" "$health" "$inflight" ;;
            foreign)
                echo "$1 on $host:$port: foreign pid file: $(foreign_pidfile "$f")" ;;
            *)
                echo "$1 on $host:$port not running (stale pid file removed)"
                remove_pidfile "$f" ;;
        esac
    done
    return "$any"
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

check_token_file() {  # check_token_file FILE: dies unless FILE is a token file only this user can read
    local mode
    mode="$(stat -c %a -- "$1" 2>/dev/null)" || die "cluster token file $1: no such file"
    if (( 8#$mode & 8#077 )); then
        die "cluster token file $1 is readable by others (mode $mode): chmod 600 $1"
    fi
}

parse_ports() {  # sets CE_PORT PE_PORT KV_BASE CE_HOST_BIND CE_HOST_SET ARGS from "$@"
    CE_PORT=8888 PE_PORT=8889 KV_BASE=8900 CE_HOST_BIND=127.0.0.1 CE_HOST_SET="" ARGS=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --port) CE_PORT="${2:?--port needs a value}"; shift 2 ;;
            --port=*) CE_PORT="${1#*=}"; shift ;;
            --pe-port) PE_PORT="${2:?--pe-port needs a value}"; shift 2 ;;
            --pe-port=*) PE_PORT="${1#*=}"; shift ;;
            --kv-port-base) KV_BASE="${2:?--kv-port-base needs a value}"; shift 2 ;;
            --kv-port-base=*) KV_BASE="${1#*=}"; shift ;;
            --host) CE_HOST_BIND="${2:?--host needs a value}" CE_HOST_SET=1; shift 2 ;;
            --host=*) CE_HOST_BIND="${1#*=}" CE_HOST_SET=1; shift ;;
            --role|--role=*|--prefill-url|--prefill-url=*|--kv-host|--kv-host=*)
                die "$1 is set by pd_run.sh itself" ;;
            -h|--help) usage 0 ;;
            *) ARGS+=("$1"); shift ;;
        esac
    done
}

split_hosts() {  # split_hosts LIST NAME: sets array NAME to LIST's hosts (comma-separated), checked
    local -n _out="$2"
    local h
    IFS=, read -r -a _out <<<"$1"
    [ "${#_out[@]}" -gt 0 ] || die "empty host list"
    for h in "${_out[@]}"; do check_host "$h"; done
    [ "$(printf '%s\n' "${_out[@]}" | sort | uniq -d)" = "" ] || die "a host is named twice in '$1'"
}

bind_of() {  # bind_of HOST: the address a server on HOST binds (127.x.y.z itself; localhost: 127.0.0.1)
    case "$1" in
        127.*) echo "$1" ;;
        localhost|::1) echo 127.0.0.1 ;;
        *) echo "$1" ;;
    esac
}

# parallel LABEL CMD...: runs `on HOST CMD...` for every host of HOSTS (an array set by the caller) at
# once; prints each one's output (stdout, stderr) in order; fails if any failed.
parallel() {
    local tmp h i=0 rc=0
    local -a pids=()
    tmp="$(mktemp -d)"
    for h in "${HOSTS[@]}"; do
        "$@" "$h" >"$tmp/$i.out" 2>"$tmp/$i.err" &
        pids+=($!)
        i=$((i + 1))
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || rc=1
        cat "$tmp/$i.out"
        cat "$tmp/$i.err" >&2
    done
    rm -rf "$tmp"
    return "$rc"
}

start_pe() {  # start_pe HOST
    local bind
    bind="$(bind_of "$1")"
    on "$1" _start pe "$bind" "$PE_PORT" "http://$bind:$PE_PORT" --host "$bind" \
        ${TOKEN_ARGS[@]+"${TOKEN_ARGS[@]}"} ${ARGS[@]+"${ARGS[@]}"}
}

ce_binds() {  # ce_binds HOST: sets CE_BIND (its OpenAI API's address), CE_KV_BIND and CE_URL (as printed)
    CE_BIND="$CE_HOST_BIND"
    CE_KV_BIND="$(bind_of "$1")"
    if is_local "$1" && [ -z "$CE_HOST_SET" ]; then CE_BIND="$CE_KV_BIND"; fi
    local show="$CE_BIND"
    [ "$show" = "0.0.0.0" ] && show="$1"
    [ "$show" = "localhost" ] && show=127.0.0.1
    CE_URL="http://$show:$CE_PORT"
}

launch_ce() {  # launch_ce HOST
    ce_binds "$1"
    on "$1" _launch ce "$CE_KV_BIND" "$CE_PORT" "$CE_URL" --host "$CE_BIND" --prefill-url "$PE_URLS" \
        --kv-host "$CE_KV_BIND" --kv-port-base "$KV_BASE" ${TOKEN_ARGS[@]+"${TOKEN_ARGS[@]}"} ${ARGS[@]+"${ARGS[@]}"}
}

wait_ce() {  # wait_ce HOST
    ce_binds "$1"
    on "$1" _wait ce "$CE_KV_BIND" "$CE_PORT" "$CE_URL" "$NUM_PES"
}

cmd_start() {
    [ $# -ge 2 ] || usage 2 >&2
    local -a pe_hosts ce_hosts
    local pe_list="$1" ce_list="$2"
    split_hosts "$pe_list" pe_hosts
    split_hosts "$ce_list" ce_hosts
    shift 2
    parse_ports "$@"
    local h any_local=0 any_remote=0
    for h in "${pe_hosts[@]}" "${ce_hosts[@]}"; do
        if is_local "$h"; then any_local=1; else any_remote=1; fi
    done
    [ "$any_local" = 0 ] || [ "$any_remote" = 0 ] || die "start: hosts on loopback and remote ones do" \
        "not mix; name this host by an address the others reach (it is then started through ssh)"
    TOKEN_ARGS=()
    if [ -n "${PDSERVE_CLUSTER_TOKEN:-}" ]; then
        :  # the servers read it from their environment
    elif [ -n "${PDSERVE_CLUSTER_TOKEN_FILE:-}" ]; then
        # A remote side reads the file its own environment names: only a file here can be checked here.
        if [ "$any_local" = 1 ] || [ -e "$PDSERVE_CLUSTER_TOKEN_FILE" ]; then
            check_token_file "$PDSERVE_CLUSTER_TOKEN_FILE"
        fi
    else
        local tf
        tf="$(internal_token)"
        check_token_file "$tf"
        for h in "${pe_hosts[@]}" "${ce_hosts[@]}"; do
            is_local "$h" || on "$h" _token --from-stdin <"$tf" >/dev/null
        done
        TOKEN_ARGS=(--cluster-token-file "$tf")
    fi
    PE_URLS=""
    for h in "${pe_hosts[@]}"; do PE_URLS+="${PE_URLS:+,}http://$(bind_of "$h"):$PE_PORT"; done
    NUM_PES="${#pe_hosts[@]}"
    # NOTE: the CEs load while the PEs do: a CE is ready once it sees a PE up (it probes each PE, and one
    # that is not up yet again within 2 s), so it is waited for only after every PE is ready.
    local -a HOSTS=("${ce_hosts[@]}")
    parallel launch_ce || die "a CE did not start (see above); the servers that did are left running"
    HOSTS=("${pe_hosts[@]}")
    parallel start_pe || die "a PE did not start (see above); the servers that did, CEs included, are left" \
        "running: start again starts only what is missing, stop ends them all"
    HOSTS=("${ce_hosts[@]}")
    parallel wait_ce || die "a CE did not start (see above); the servers that did are left running"
    local eps=""
    for h in "${ce_hosts[@]}"; do ce_binds "$h"; eps+="${eps:+ }$CE_URL/v1"; done
    if [ "${#pe_hosts[@]}" -eq 1 ] && [ "${#ce_hosts[@]}" -eq 1 ]; then
        echo "P/D pair ready: $eps (prefill on ${pe_hosts[0]}:$PE_PORT, decode on ${ce_hosts[0]})"
    else
        echo "P/D cluster ready: ${#pe_hosts[@]} PE(s), ${#ce_hosts[@]} CE(s); OpenAI endpoints: $eps"
    fi
    echo "stop it with: deploy/pd_run.sh stop $pe_list $ce_list"
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

stop_ce() { on "$1" _stop ce "$(bind_of "$1")" "$CE_PORT_ARG"; }
stop_pe() { on "$1" _stop pe "$(bind_of "$1")" "$PE_PORT_ARG"; }

cmd_stop() {
    [ $# -ge 2 ] || usage 2 >&2
    local -a pe_hosts ce_hosts
    split_hosts "$1" pe_hosts
    split_hosts "$2" ce_hosts
    shift 2
    local CE_PORT_ARG="" PE_PORT_ARG=""
    parse_side_ports stop "$@"
    # The CEs first: they drain while the PEs still serve their prefills.
    local rc=0
    local -a HOSTS=("${ce_hosts[@]}")
    parallel stop_ce || rc=1
    HOSTS=("${pe_hosts[@]}")
    parallel stop_pe || rc=1
    return "$rc"
}

cmd_status() {
    local -a pe_hosts=() ce_hosts=()
    if [ $# -ge 2 ] && [ "${1#-}" = "$1" ]; then
        split_hosts "$1" pe_hosts
        split_hosts "$2" ce_hosts
        shift 2
    fi
    local CE_PORT_ARG="" PE_PORT_ARG=""
    parse_side_ports status "$@"
    local rc=3 h
    printf '%-16s %-4s %-6s %-8s %-12s %-16s %s\n' HOST ROLE PORT PID RANKS HEALTH INFLIGHT
    if [ "${#pe_hosts[@]}" -eq 0 ]; then  # every server this RUN_DIR knows of, here
        internal_status pe '*' "$PE_PORT_ARG" && rc=0
        internal_status ce '*' "$CE_PORT_ARG" && rc=0
        return "$rc"
    fi
    for h in "${pe_hosts[@]}"; do on "$h" _status pe "$(bind_of "$h")" "$PE_PORT_ARG" && rc=0; done
    for h in "${ce_hosts[@]}"; do on "$h" _status ce "$(bind_of "$h")" "$CE_PORT_ARG" && rc=0; done
    return "$rc"
}

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) shift; cmd_stop "$@" ;;
    status) shift; cmd_status "$@" ;;
    _start) shift; internal_start "$@" ;;
    _launch) shift; internal_launch "$@" ;;
    _wait) shift; internal_wait "$@" ;;
    _stop) shift; internal_stop "$@" ;;
    _status) shift; internal_status "$@" ;;
    _token) shift; internal_token "$@" ;;
    -h|--help|help) usage 0 ;;
    *) usage 2 >&2 ;;
esac
