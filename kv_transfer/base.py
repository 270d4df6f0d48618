"""The transport interface, prefill side. Each transport's receiving half is
a method of ``KVReceiver`` that the decode worker's servicer calls."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

from kv_transfer.layout import TransferStats
from rpc.protos import worker_pb2

logger = logging.getLogger("kv_transfer")

# What a preflight pushes through a transport to measure its bandwidth.
PREFLIGHT_BYTES = 8 << 20


class KVSender(ABC):
    """Moves the KV of ``src_block_ids`` (this worker's cache) into the
    blocks of ``ticket`` on the decode worker.

    Contract: returns only once the decode worker has acknowledged every
    byte; raises on any failure (the caller retries or fails the request).
    The source blocks must stay untouched until it returns, cancellation
    included. The caller has already checked the decode worker's layout
    against its own.

    Preflight: the first time a sender reaches a decode worker it pushes
    ``PREFLIGHT_BYTES`` of filler that the peer drops, and reports the
    bandwidth to ``on_preflight`` observers (metrics, logs). A failed
    preflight is logged, never fatal: the transfer itself decides.
    """

    name: str
    # True: the sender implements ``send_progressive`` and can stream blocks
    # while a chunked prefill is still computing later ones.
    streams_during_compute = False
    # True: the sender implements ``send_when`` (every layer, once the forward
    # pass that completes the prompt is over) and ``layer_sink`` with
    # ``send_layers`` (each layer as soon as it is stored), both opening the
    # transfer while the prompt computes.
    sends_by_layer = False

    def __init__(self) -> None:
        # Decode worker id -> bytes/s measured at first contact (None: failed).
        self.bandwidth: dict[str, float | None] = {}
        # Observers of preflights: (transport, peer worker id, bytes per second).
        self.on_preflight: list[Callable[[str, str, float], None]] = []

    @abstractmethod
    async def send(
        self, request_id: str, ticket: worker_pb2.Ticket, src_block_ids: list[int]
    ) -> TransferStats: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def report_preflight(self, peer: str, nbytes: int, seconds: float | None) -> None:
        """Record a preflight's result (``seconds`` None: it failed)."""
        if seconds is None:
            self.bandwidth[peer] = None
            return
        rate = nbytes / max(seconds, 1e-9)
        self.bandwidth[peer] = rate
        logger.info("preflight %s -> %s: %.1f MiB in %.1f ms = %.0f MiB/s", self.name, peer,
                    nbytes / 2**20, seconds * 1e3, rate / 2**20)
        for fn in self.on_preflight:
            fn(self.name, peer, rate)
