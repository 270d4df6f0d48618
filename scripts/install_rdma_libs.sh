#!/usr/bin/env bash
# The Mooncake transfer engine's library links against libibverbs and
# librdmacm even when it only speaks TCP: install Debian's packages when
# they are missing (as scripts/test.sh does for redis-server). Without them
# the mooncake KV transport cannot start and workers fall back to the next
# transport in their --transport list.
set -euo pipefail
if ldconfig -p | grep -q 'libibverbs.so.1' && ldconfig -p | grep -q 'librdmacm.so.1'; then
    exit 0
fi
echo "installing libibverbs1 and librdmacm1 (Debian packages, for the mooncake transport)"
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null \
        || echo "could not install libibverbs1/librdmacm1: the mooncake transport will not start" >&2
fi
