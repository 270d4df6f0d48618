"""The decode side of every transport: KV lands in reserved blocks.

A reservation registers the blocks a request's KV may be written to. Bytes
for an unknown request, a stale attempt, a block index outside the
reservation or a wrong size are refused. A reservation cancelled while bytes
are being written is released only once the writer stops, so freed blocks
are never written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from engine.dtypes import TORCH_DTYPES
from engine.kv_blocks import KVBlockView
from kv_transfer.block_io import from_bytes
from kv_transfer.layout import KVLayout
from kv_transfer.torch_transport import PREFLIGHT_TAG, PairGroup, join_group, transfer_tag
from rpc.errors import Fenced, NotFound
from rpc.protos import worker_pb2

logger = logging.getLogger("kv_transfer")

# Largest preflight payload a decode worker accepts to receive and drop.
MAX_PREFLIGHT_BYTES = 64 << 20


@dataclass
class Reservation:
    block_ids: list[int]
    attempt: int
    bytes_received: int = 0
    complete: bool = False
    writing: bool = False
    cancelled: bool = False
    completed_at: float | None = None  # monotonic time the last byte landed


class KVReceiver:
    def __init__(self, io: KVBlockView, layout: KVLayout,
                 release: Callable[[str], None]) -> None:
        """``release(request_id)`` frees a cancelled reservation's blocks."""
        self.io = io
        self.layout = layout
        self.release = release
        self.reservations: dict[str, Reservation] = {}
        self.groups: dict[str, PairGroup] = {}
        # Observers of finished transfers: (transport, bytes, seconds, ok).
        self.on_transfer: list[Callable[[str, int, float, bool], None]] = []

    # ---- reservations (called by the worker) ------------------------------------

    def expect(self, request_id: str, block_ids: list[int], attempt: int) -> None:
        self.reservations[request_id] = Reservation(list(block_ids), attempt)

    def is_complete(self, request_id: str) -> bool:
        r = self.reservations.get(request_id)
        return r is not None and r.complete

    def forget(self, request_id: str) -> None:
        """The request started decoding: its blocks now belong to the engine."""
        self.reservations.pop(request_id, None)

    def cancel(self, request_id: str) -> bool:
        """Drop a reservation. Returns True if its blocks may be freed now;
        False if a transfer is writing them (they are released when it stops)."""
        r = self.reservations.get(request_id)
        if r is None:
            return True
        if r.writing:
            r.cancelled = True
            return False
        del self.reservations[request_id]
        return True

    # ---- grpc transport ------------------------------------------------------------

    async def receive_grpc(self, chunks: AsyncIterator[worker_pb2.KVChunk]) -> int:
        request_id, r, start = None, None, time.perf_counter()
        try:
            async for chunk in chunks:
                if r is None:
                    request_id = chunk.request_id
                    self.layout.check_compatible(KVLayout.from_proto(chunk.layout), "sender")
                    r = self._begin(request_id, chunk.attempt)
                self._check_live(request_id, r)
                ids = self._slice(r, chunk.first_block, chunk.num_blocks)
                like = self.io.empty(None, len(ids))
                if len(chunk.data) != like.numel() * like.element_size():
                    raise ValueError(
                        f"KV chunk of {len(chunk.data)} bytes, expected "
                        f"{like.numel() * like.element_size()}"
                    )
                # NOTE: on the event loop on purpose: an abort marks the
                # request on the loop, so no write is still running when its
                # blocks are freed. With tensor parallelism it waits for the
                # running step (the group's lock).
                self.io.write_layer(chunk.layer, ids, from_bytes(chunk.data, like))
                r.bytes_received += len(chunk.data)
            if r is None:
                raise ValueError("empty KV stream")
            return self._finish(request_id, r, "grpc", start)
        except BaseException:
            if r is not None:
                self._abandon(request_id, r, "grpc", start)
            raise

    # ---- torch.distributed transport ----------------------------------------------------

    async def open_group(self, req: worker_pb2.OpenTransferGroupRequest) -> None:
        if req.preflight_bytes > MAX_PREFLIGHT_BYTES:
            raise ValueError(f"preflight of {req.preflight_bytes} bytes; at most "
                             f"{MAX_PREFLIGHT_BYTES}")
        loop = asyncio.get_running_loop()
        group = await loop.run_in_executor(
            None, join_group, req.store_address, req.group_name, self.io.device
        )
        pair = PairGroup(group)
        old = self.groups.get(req.prefill_worker_id)
        self.groups[req.prefill_worker_id] = pair
        if old is not None:
            old.thread.shutdown(wait=False)
        if req.preflight_bytes:
            # Queued first on the pair's thread, so it pairs with the sender's
            # preflight before any transfer; the sender times the round trip.
            payload = torch.empty(req.preflight_bytes, dtype=torch.uint8, device=self.io.device)
            ack = torch.ones(1, dtype=torch.uint8, device=self.io.device)

            def drop_and_answer() -> None:
                pair.recv(payload, 0, PREFLIGHT_TAG)
                pair.send(ack, 0, PREFLIGHT_TAG)

            pair.submit(drop_and_answer).add_done_callback(_log_failure("torch preflight"))

    async def receive_torch(self, req: worker_pb2.ExpectKVRequest) -> int:
        pair = self.groups.get(req.prefill_worker_id)
        if pair is None or pair.broken:
            raise NotFound(f"no transfer group with prefill worker {req.prefill_worker_id!r}")
        tag = transfer_tag(req.request_id)
        try:
            self.layout.check_compatible(KVLayout.from_proto(req.layout), "sender")
            r = self._begin(req.request_id, req.attempt)
        except Exception:
            # NOTE: the sender's send is already posted: take its bytes and drop
            # them, or it waits for gloo's timeout and the pair closes for good.
            await self._drop_torch(pair, req, tag)
            raise
        start = time.perf_counter()
        try:
            if req.num_blocks != len(r.block_ids):
                await self._drop_torch(pair, req, tag)
                raise ValueError(f"{req.num_blocks} blocks announced, {len(r.block_ids)} reserved")
            buf = self.io.empty(self.layout.num_layers, req.num_blocks)
            await pair.run(pair.recv, buf, 0, tag)
            self._check_live(req.request_id, r)
            await pair.run(self.io.write, r.block_ids, buf)
            r.bytes_received = buf.numel() * buf.element_size()
            return self._finish(req.request_id, r, "torch", start)
        except BaseException:
            self._abandon(req.request_id, r, "torch", start)
            raise

    async def _drop_torch(self, pair: PairGroup, req: worker_pb2.ExpectKVRequest,
                          tag: int) -> None:
        """Receive a refused transfer's bytes into scratch memory. Skipped
        (the sender then times out) when the announced size is not sane."""
        dtype = TORCH_DTYPES.get(req.layout.dtype)
        if dtype is None or not 0 < req.num_blocks <= self.io.num_blocks:
            return
        sender = KVLayout.from_proto(req.layout)
        nbytes = req.num_blocks * sender.block_bytes_per_layer * sender.num_layers
        if nbytes > 2 * req.num_blocks * self.layout.block_bytes_per_layer * self.layout.num_layers:
            return
        itemsize = torch.finfo(dtype).bits // 8
        scratch = torch.empty(nbytes // itemsize, dtype=dtype, device=self.io.device)
        try:
            await pair.run(pair.recv, scratch, 0, tag)
        except Exception as exc:
            logger.warning("could not drop a refused transfer of %s: %s", req.request_id, exc)

    # ---- mooncake transport ---------------------------------------------------------------

    async def receive_mooncake(self, messages: AsyncIterator[worker_pb2.WriteKVMessage],
                               ) -> AsyncIterator[worker_pb2.WriteKVReply]:
        """The control half of a one-sided write (kv_transfer/mooncake_transport.py):
        begin -> ready (the reservation is marked as being written), then
        done -> the bytes, once the completion count matches the reservation."""
        it = aiter(messages)
        begin = await anext(it, None)
        if begin is None or begin.WhichOneof("kind") != "begin":
            raise ValueError("a mooncake transfer starts with a begin message")
        b = begin.begin
        self.layout.check_compatible(KVLayout.from_proto(b.layout), "sender")
        r = self._begin(b.request_id, b.attempt)
        start, finished = time.perf_counter(), False
        try:
            if b.num_blocks != len(r.block_ids):
                raise ValueError(f"{b.num_blocks} blocks announced, {len(r.block_ids)} reserved")
            yield worker_pb2.WriteKVReply(ready=True)
            done = await anext(it, None)
            if done is None or done.WhichOneof("kind") != "done":
                raise ValueError("the mooncake transfer ended before its done message")
            if done.done.num_blocks != len(r.block_ids):
                raise ValueError(f"{done.done.num_blocks} blocks written, "
                                 f"{len(r.block_ids)} reserved")
            layers = list(done.done.layer_blocks)
            if layers and layers != [len(r.block_ids)] * self.layout.num_layers:
                raise ValueError(f"written by layer: {layers} blocks; {len(r.block_ids)} in "
                                 f"each of {self.layout.num_layers} layers expected")
            r.bytes_received = done.done.bytes_written
            received = self._finish(b.request_id, r, "mooncake", start)  # checks the count
            finished = True
        except BaseException:
            if not finished:
                self._abandon(b.request_id, r, "mooncake", start)
            raise
        yield worker_pb2.WriteKVReply(bytes_received=received)

    # ---- grpc preflight ---------------------------------------------------------------------

    async def receive_preflight(self, chunks: AsyncIterator[worker_pb2.PreflightChunk]) -> int:
        received = 0
        async for chunk in chunks:
            received += len(chunk.data)
            if received > MAX_PREFLIGHT_BYTES:
                raise ValueError(f"preflight of more than {MAX_PREFLIGHT_BYTES} bytes")
        return received

    # ---- internals --------------------------------------------------------------------------

    def _begin(self, request_id: str, attempt: int) -> Reservation:
        r = self.reservations.get(request_id)
        if r is None:
            raise NotFound(f"no reservation for request {request_id!r} (expired or aborted?)")
        if attempt != r.attempt:
            raise Fenced(f"KV for attempt {attempt} of {request_id!r}; reserved for {r.attempt}")
        if r.writing or r.complete:
            raise ValueError(f"KV for {request_id!r} is already being received")
        r.writing = True
        return r

    def _check_live(self, request_id: str, r: Reservation) -> None:
        if r.cancelled:
            raise NotFound(f"request {request_id!r} was aborted during the transfer")

    def _slice(self, r: Reservation, first: int, n: int) -> list[int]:
        if n < 1 or first + n > len(r.block_ids):
            raise ValueError(f"blocks [{first}, {first + n}) outside the {len(r.block_ids)} reserved")
        return r.block_ids[first : first + n]

    def _finish(self, request_id: str, r: Reservation, transport: str, start: float) -> int:
        self._check_live(request_id, r)
        expected = len(r.block_ids) * self.layout.block_bytes_per_layer * self.layout.num_layers
        if r.bytes_received != expected:
            raise ValueError(f"received {r.bytes_received} KV bytes, expected {expected}")
        r.writing = False
        r.complete = True
        r.completed_at = time.monotonic()
        self._notify(transport, r.bytes_received, start, True)
        return r.bytes_received

    def _abandon(self, request_id: str, r: Reservation, transport: str, start: float) -> None:
        r.writing = False
        r.bytes_received = 0
        self._notify(transport, 0, start, False)
        if r.cancelled:
            self.reservations.pop(request_id, None)
            self.release(request_id)

    def _notify(self, transport: str, nbytes: int, start: float, ok: bool) -> None:
        for fn in self.on_transfer:
            fn(transport, nbytes, time.perf_counter() - start, ok)


def _log_failure(what: str):
    def callback(future) -> None:
        if not future.cancelled() and future.exception() is not None:
            logger.warning("%s failed: %s", what, future.exception())

    return callback
