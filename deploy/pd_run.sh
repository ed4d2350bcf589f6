#!/usr/bin/env bash
# The P/D pair: a prefill engine (PE) on one host, a decode engine + OpenAI coordinator (CE) on another.
#
#   deploy/pd_run.sh start <pe-host> <ce-host> [--port P] [--pe-port P] [--kv-port-base P] [server flags]
#   deploy/pd_run.sh stop <pe-host> <ce-host> [--port P] [--pe-port P]
#   deploy/pd_run.sh status [<pe-host> <ce-host>] [--port P] [--pe-port P]
#
# start runs `python -m pd.server --role pe` on pe-host (POST /prefill on --pe-port, 8889) and
# `--role ce` on ce-host (OpenAI API on --port, 8888; KV receivers on --kv-port-base + rank, 8900+),
# each in its own process group, waits for both /health/ready and prints the endpoint. It starts only
# what is not running as it should: after a PE crash, running it again brings the PE back and leaves the
# CE alone; a side with a rank down for good (its restart limit reached), or that does not answer
# /health, is stopped and started anew. Server flags (--model, --dp, --deterministic, --max-model-len,
# ...) go to both sides.
# stop sends SIGTERM to each side's server (the CE first): it stops admitting requests, lets those in
# flight finish (up to --shutdown-timeout, 30 s), stops its engine ranks and exits; whatever of its
# process group is left after $PDSERVE_STOP_TIMEOUT_S (45 s) gets SIGKILL: no engine survives anywhere.
# A pid file is trusted only while it names a live pd.server of this user: one naming another process is
# reported and never signalled (stop exits 1), one naming nothing is removed.
#
# Hosts: localhost or 127.x runs there locally; any other host through ssh, with the repository at the
# same path (a host name starting with '-' is refused: ssh would read it as an option). A remote PE binds
# pe-host (the CE's coordinator reaches it there); a remote CE binds its KV receivers to ce-host. Locally
# everything binds 127.0.0.1, so the hosts are both local or both remote.
# Cluster token: $PDSERVE_CLUSTER_TOKEN or $PDSERVE_CLUSTER_TOKEN_FILE if set, else RUN_DIR/cluster.token
# (made once, mode 600, copied to a remote host's RUN_DIR). A token file that group or others may read
# is refused, here and by the server (chmod 600 it). Logs and pid files: RUN_DIR (default run/, or
# $PDSERVE_RUN_DIR) as pd-pe-PORT.{log,pid} and pd-ce-PORT.{log,pid}; deploy/server.sh's server-PORT.*
# files are another name space, so a single-engine server runs beside the pair.
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

# _start ROLE PORT URL [server flags]: starts one side unless it runs as it should (keep_running);
# waits until it is ready.
internal_start() {
    local role="$1" port="$2" url="$3"; shift 3
    local pidfile="$RUN_DIR/pd-$role-$port.pid"
    if keep_running "$role" "$port" "$pidfile" "$url"; then
        echo "$role already running on port $port (pid $PIDFILE_PID): $url"
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

# _stop ROLE [PORT]: exit 1 when a pid file names a process that is not ours (left alone)
internal_stop() {
    local -a files; local f rc=0
    mapfile -t files < <(pidfiles "$1" "${2:-}")
    if [ "${#files[@]}" -eq 0 ]; then
        echo "no $1 running${2:+ on port $2} ($(hostname))"
        return 0
    fi
    for f in "${files[@]}"; do stop_pidfile "$f" || rc=1; done
    return "$rc"
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

check_token_file() {  # check_token_file FILE: dies unless FILE is a token file only this user can read
    local mode
    mode="$(stat -c %a -- "$1" 2>/dev/null)" || die "cluster token file $1: no such file"
    if (( 8#$mode & 8#077 )); then
        die "cluster token file $1 is readable by others (mode $mode): chmod 600 $1"
    fi
}

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
    check_host "$pe_host"
    check_host "$ce_host"
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
    if [ -n "${PDSERVE_CLUSTER_TOKEN:-}" ]; then
        :  # the servers read it from their environment
    elif [ -n "${PDSERVE_CLUSTER_TOKEN_FILE:-}" ]; then
        # A remote side reads the file its own environment names: only a file here can be checked here.
        if [ "$pe_local" = 1 ] || [ -e "$PDSERVE_CLUSTER_TOKEN_FILE" ]; then
            check_token_file "$PDSERVE_CLUSTER_TOKEN_FILE"
        fi
    else
        local tf
        tf="$(internal_token)"
        check_token_file "$tf"
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
    check_host "$pe_host"
    check_host "$ce_host"
    local CE_PORT_ARG="" PE_PORT_ARG=""
    parse_side_ports stop "$@"
    # The CE first: it drains while the PE still serves its prefills.
    local rc=0
    on "$ce_host" _stop ce "$CE_PORT_ARG" || rc=1
    on "$pe_host" _stop pe "$PE_PORT_ARG" || rc=1
    return "$rc"
}

cmd_status() {
    local pe_host=localhost ce_host=localhost
    if [ $# -ge 2 ] && [ "${1#-}" = "$1" ]; then pe_host="$1" ce_host="$2"; shift 2; fi
    check_host "$pe_host"
    check_host "$ce_host"
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
