#!/usr/bin/env bash
# write-conf.sh LISTEN HOST:PORT...: kvserve.conf.template with the address nginx listens on
# (LISTEN: PORT or HOST:PORT; a bare port listens on 127.0.0.1) and one upstream server per
# replica, on stdout. deploy/run-local.sh and tests/e2e/test_nginx.py both write theirs here.
#
# MAX_FAILS / FAIL_TIMEOUT (default 1 / 5s): nginx's passive health check per server.
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 LISTEN HOST:PORT..." >&2
    exit 2
fi
listen=$1
shift
[[ $listen == *:* ]] || listen="127.0.0.1:$listen"

servers=""
for addr in "$@"; do
    if [[ ! $addr =~ ^[A-Za-z0-9.-]+:[0-9]+$ ]]; then
        echo "$0: not HOST:PORT: $addr" >&2
        exit 2
    fi
    servers+="        server $addr max_fails=${MAX_FAILS:-1} fail_timeout=${FAIL_TIMEOUT:-5s};"$'\n'
done
servers=${servers%$'\n'}

template="$(dirname "$0")/kvserve.conf.template"
while IFS= read -r line || [[ -n $line ]]; do
    case $line in
        @SERVERS@) printf '%s\n' "$servers" ;;
        *) printf '%s\n' "${line//@LISTEN@/$listen}" ;;
    esac
done < "$template"
