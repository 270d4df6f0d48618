#!/usr/bin/env bash
# Runs the whole suite against a real Redis server started here on a free
# port (installed from Debian when missing) and stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null; then
    echo "installing redis-server (Debian package)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
if ! ldconfig -p | grep -q 'libibverbs.so.1' || ! ldconfig -p | grep -q 'librdmacm.so.1'; then
    bash scripts/install_rdma_libs.sh
fi
if ! command -v docker-compose >/dev/null; then
    echo "installing docker-compose (validation only; no Docker engine runs here)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; }
fi

port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
workdir=$(mktemp -d)
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize yes --pidfile "$workdir/redis.pid" --dir "$workdir" --logfile "$workdir/redis.log"
cleanup() {
    redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || kill "$(cat "$workdir/redis.pid" 2>/dev/null)" 2>/dev/null || true
    for _ in $(seq 50); do [ -e "$workdir/redis.pid" ] || break; sleep 0.1; done
    rm -rf "$workdir" 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done

export TANDEM_TEST_REDIS_URL="redis://127.0.0.1:$port/0"
# The slowest tests are listed at the end: the suite has to stay well under 20 minutes.
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 "$@"
