"""The transport interface, prefill side. Each transport's receiving half is
a method of ``KVReceiver`` that the decode worker's servicer calls."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kv_transfer.layout import TransferStats
from rpc.protos import worker_pb2


class KVSender(ABC):
    """Moves the KV of ``src_block_ids`` (this worker's cache) into the
    blocks of ``ticket`` on the decode worker.

    Contract: returns only once the decode worker has acknowledged every
    byte; raises on any failure (the caller retries or fails the request).
    The source blocks must stay untouched until it returns. The caller has
    already checked the decode worker's layout against its own.
    """

    name: str

    @abstractmethod
    async def send(
        self, request_id: str, ticket: worker_pb2.Ticket, src_block_ids: list[int]
    ) -> TransferStats: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass
