#!/usr/bin/env bash
# run-local.sh N [-- COMMAND...]: N `kvserve serve` replicas on loopback behind nginx.
#
# Starts the replicas, waits until each /health is 200, writes the nginx config
# (deploy/nginx/write-conf.sh) into a temporary prefix, starts nginx there, and prints the URL.
# With `-- COMMAND...` it runs the command with KVSERVE_URL set to that URL, tears everything
# down and exits with the command's status; without, it serves until SIGINT / SIGTERM (or
# until a replica or nginx exits), then tears everything down. Teardown: nginx stops taking
# connections, the replicas get SIGTERM and drain (kvserve's --shutdown-timeout), and the
# script waits for every process it started; what is still there after the grace period gets
# SIGKILL.
#
# Environment:
#   KVSERVE_ARGS       extra `kvserve serve` flags for every replica (split on whitespace;
#                      not --host / --port, which this script sets), e.g.
#                      "--max-num-seqs 4 --api-key secret"
#   KVSERVE_BASE_PORT  replica i (0-based) listens on 127.0.0.1:(KVSERVE_BASE_PORT + i)
#                      (default 8001)
#   NGINX_PORT         nginx listens on 127.0.0.1:NGINX_PORT (default 8080)
#   KVSERVE            the kvserve command (default: kvserve on PATH, else ./.venv/bin/kvserve)
#   NGINX              the nginx binary (default: nginx on PATH, else /usr/sbin/nginx)
#   KVSERVE_NUM_THREADS  threads per replica (default: this script's CPUs / N, at least 1)
#   PIN_REPLICAS       0: do not pin replica i to its own slice of the CPUs (taskset)
#   STARTUP_TIMEOUT    seconds a replica may take to become healthy (default 600)
#   STOP_TIMEOUT       seconds teardown waits for the replicas before SIGKILL (default 60;
#                      keep it above --shutdown-timeout, 30 s by default)
# shellcheck disable=SC2329  # teardown and its wait_gone run from the EXIT trap
set -euo pipefail

usage() {
    echo "usage: $0 N [-- COMMAND...]   (N >= 1 kvserve replicas behind nginx)" >&2
    exit 2
}

[[ $# -ge 1 && $1 =~ ^[1-9][0-9]*$ ]] || usage
n=$1
shift
if [[ $# -gt 0 ]]; then
    [[ $1 == -- && $# -ge 2 ]] || usage
    shift
fi

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
base_port=${KVSERVE_BASE_PORT:-8001}
nginx_port=${NGINX_PORT:-8080}
read -r -a kvserve_args <<< "${KVSERVE_ARGS:-}"

kvserve=${KVSERVE:-}
if [[ -z $kvserve ]]; then
    kvserve=$(command -v kvserve || true)
    [[ -n $kvserve ]] || kvserve="$repo/.venv/bin/kvserve"
fi
nginx=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
for tool in "$kvserve" "$nginx" curl; do
    command -v "$tool" >/dev/null || { echo "$0: $tool not found" >&2; exit 1; }
done

say() { echo "run-local: $*" >&2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/kvserve-local.XXXXXX")
replica_pids=()
nginx_pid=""

# A process of ours that has exited and been reaped no longer answers kill -0 (bash reaps
# its background children as they exit and keeps their status for `wait`).
alive() { kill -0 "$1" 2>/dev/null; }

wait_gone() {  # wait_gone SECONDS PID...: 0 once none of the PIDs is alive, 1 at the limit
    local deadline=$((SECONDS + $1)) pid any
    shift
    while :; do
        any=0
        for pid in "$@"; do
            if alive "$pid"; then any=1; fi
        done
        ((any)) || return 0
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

teardown() {
    trap - EXIT INT TERM
    local pid
    # nginx first (SIGQUIT: it stops accepting and finishes what it proxies), then the
    # replicas, which drain their running requests; nginx exits once those have ended.
    if [[ -n $nginx_pid ]] && alive "$nginx_pid"; then kill -QUIT "$nginx_pid" 2>/dev/null || true; fi
    for pid in "${replica_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    if ! wait_gone "${STOP_TIMEOUT:-60}" "${replica_pids[@]}"; then
        say "replicas still running after ${STOP_TIMEOUT:-60}s; killing them"
        for pid in "${replica_pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    fi
    if [[ -n $nginx_pid ]] && ! wait_gone 10 "$nginx_pid"; then
        kill -KILL "$nginx_pid" 2>/dev/null || true
    fi
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap 'teardown' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Each child runs in its own session (setsid), so that a terminal's Ctrl-C reaches only this
# script, which then stops them in order, instead of every process at once. spawn is only
# ever run in the background (&): its exec replaces that subshell, so $! is the program's pid.
spawn() { if command -v setsid >/dev/null; then exec setsid "$@"; else exec "$@"; fi; }

# Cores: replica i gets its own slice of this script's CPUs (taskset) and as many threads.
# Left alone, each replica would start a thread per core and the N would fight over the same
# cores (about 50x slower for two replicas on two cores).
mapfile -t cpus < <(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)), sep="\n")')
per=$(( ${#cpus[@]} / n ))
(( per >= 1 )) || per=1
replica_cores() {
    local out=() k
    for ((k = 0; k < per; k++)); do out+=("${cpus[$(( ($1 * per + k) % ${#cpus[@]} ))]}"); done
    (IFS=,; echo "${out[*]}")
}
pin=()

upstreams=()
for ((i = 0; i < n; i++)); do
    port=$((base_port + i))
    if [[ ${PIN_REPLICAS:-1} != 0 ]] && command -v taskset >/dev/null; then
        pin=(taskset -c "$(replica_cores "$i")")
    fi
    spawn env "KVSERVE_NUM_THREADS=${KVSERVE_NUM_THREADS:-$per}" "${pin[@]}" \
        "$kvserve" serve --host 127.0.0.1 --port "$port" "${kvserve_args[@]}" \
        > "$work/replica-$i.log" 2>&1 < /dev/null &
    replica_pids+=("$!")
    upstreams+=("127.0.0.1:$port")
    say "replica $i: pid $! on http://127.0.0.1:$port (log $work/replica-$i.log)"
done

healthy() { [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1/health") == 200 ]]; }

deadline=$((SECONDS + ${STARTUP_TIMEOUT:-600}))
for ((i = 0; i < n; i++)); do
    until healthy "http://${upstreams[i]}"; do
        if ! alive "${replica_pids[i]}"; then
            say "replica $i exited during start-up:"
            tail -n 20 "$work/replica-$i.log" >&2
            exit 1
        fi
        if ((SECONDS >= deadline)); then
            say "replica $i not healthy after ${STARTUP_TIMEOUT:-600}s:"
            tail -n 20 "$work/replica-$i.log" >&2
            exit 1
        fi
        sleep 0.5
    done
done

"$here/nginx/write-conf.sh" "127.0.0.1:$nginx_port" "${upstreams[@]}" > "$work/nginx.conf"
spawn "$nginx" -p "$work/" -c "$work/nginx.conf" -e "$work/error.log" -g 'daemon off;' \
    < /dev/null &
nginx_pid=$!
url="http://127.0.0.1:$nginx_port"
until healthy "$url"; do
    if ! alive "$nginx_pid"; then
        say "nginx exited during start-up:"
        tail -n 20 "$work/error.log" >&2
        exit 1
    fi
    sleep 0.2
done
say "nginx: pid $nginx_pid; config $work/nginx.conf; logs $work/{access,error}.log"
say "serving $n replica(s) at $url"

if [[ $# -gt 0 ]]; then
    status=0
    KVSERVE_URL=$url "$@" || status=$?
    exit "$status"
fi
say "Ctrl-C (or SIGTERM) stops everything"
# wait -n returns when one child exits, or at once for a signal (the traps then tear down).
wait -n "$nginx_pid" "${replica_pids[@]}" || true
say "a replica or nginx exited; stopping the rest"
exit 1
