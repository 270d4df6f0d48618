"""Which peers a worker may connect to.

A Prefill call names the decode worker to push KV to (``Ticket``'s
``decode_worker_id`` and ``decode_address``), and an OpenTransferGroup call
names the prefill worker's rendezvous store (``store_address``). Were they
taken on trust, anyone who reaches a worker could make it open connections
to any host and port. So before any connection, the named peer must be a
worker this one knows:

- an address given with ``--peer`` (a cluster without a registry), or
- the address the worker registered under its id in the registry
  (``tandem:worker:{id}``, worker/registry.py), with the right role.

A store is on the prefill worker's own host at a port chosen when it is
first needed, so only its host is checked (against that worker's record).

A worker given neither ``--peer`` nor ``--state-url`` has no list to check
against and trusts what its callers name (logged at start): keep such a
worker where only the gateway reaches it, or turn on mTLS.

Confirmations are kept: a peer confirmed within ``REFRESH_S`` is not looked
up again, and one confirmed within ``TRUST_S`` stays trusted while the
registry is down or restarting (its workers re-register within a second).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable

from rpc.errors import PermissionDenied, Unavailable
from worker.registry import PREFIX

logger = logging.getLogger("worker")

REFRESH_S = 2.0
TRUST_S = 30.0
DECODE_ROLES = ("decode", "both")


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too); ValueError for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not a host:port address")
    return host.strip("[]"), int(port)


class PeerPolicy:
    def __init__(self, static: Iterable[str] = (), registry_url: str | None = None) -> None:
        self.static = set(static)
        for address in self.static:
            split_address(address)
        self.static_hosts = {split_address(a)[0] for a in self.static}
        self.registry_url = registry_url
        self._redis = None
        self._confirmed: dict[tuple[str, str], float] = {}  # (id, role or host) -> when

    @property
    def open(self) -> bool:
        """No list to check against: every peer a caller names is allowed."""
        return not self.static and not self.registry_url

    async def check_decode(self, worker_id: str, address: str) -> None:
        """The decode worker a ticket names: ``address`` must be a ``--peer``
        or where ``worker_id`` is registered as a decode (or 'both') worker."""
        split_address(address)
        if self.open or address in self.static:
            return
        if self.registry_url and await self._registered(
                worker_id, lambda r: r.get("address") == address
                and r.get("role") in DECODE_ROLES, address):
            return
        raise PermissionDenied(f"{address} is not a registered decode worker "
                               f"({worker_id!r}): a worker connects only to registered peers")

    async def check_store(self, worker_id: str, store_address: str) -> None:
        """A prefill worker's rendezvous store: on a ``--peer``'s host, or on
        the host ``worker_id`` is registered at as a prefill worker."""
        host, _ = split_address(store_address)
        if self.open or host in self.static_hosts:
            return
        if self.registry_url and await self._registered(
                worker_id, lambda r: r.get("role") == "prefill"
                and split_address(r.get("address", ""))[0] == host, host):
            return
        raise PermissionDenied(f"{store_address} is not on the host of a registered prefill "
                               f"worker ({worker_id!r}): a worker connects only to registered "
                               "peers")

    async def _registered(self, worker_id: str, matches, what: str) -> bool:
        key = (worker_id, what)
        now = time.monotonic()
        confirmed = self._confirmed.get(key)
        if confirmed is not None and now - confirmed < REFRESH_S:
            return True
        trusted = confirmed is not None and now - confirmed < TRUST_S
        try:
            raw = await self._client().get(PREFIX + worker_id)
        except Exception as exc:  # the registry is down: what was confirmed lately stands
            if trusted:
                return True
            raise Unavailable(f"cannot check peer {worker_id!r} at {what}: the worker "
                              f"registry is unreachable ({exc})") from None
        try:
            ok = raw is not None and matches(json.loads(raw))
        except ValueError:  # a record that is not ours
            ok = False
        if ok:
            self._confirmed[key] = now
            return True
        return trusted  # registrations lapse for a moment when the registry restarts

    def _client(self):
        if self._redis is None:
            import redis.asyncio as redis

            self._redis = redis.from_url(self.registry_url, decode_responses=True,
                                         socket_timeout=1.0, socket_connect_timeout=1.0)
        return self._redis

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
