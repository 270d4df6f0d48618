"""The decode side of every transport: KV lands in reserved blocks.

A reservation registers the blocks a request's KV may be written to. Bytes
for an unknown request, a stale attempt, a block index outside the
reservation or a wrong size are refused. A reservation cancelled while bytes
are being written is released only once the writer stops, so freed blocks
are never written. Every write into a reservation's blocks runs on the event
loop, where reservations change, so none runs after one is released.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from engine.kv_blocks import KVBlockView
from engine.parallel.sharded_kv import write_local
from kv_transfer.block_io import from_bytes
from kv_transfer.layout import KVLayout
from kv_transfer.torch_pair import PAYLOAD_TAG, PREFLIGHT_TAG, PairGroup, join_group
from rpc.errors import Fenced, NotFound, Unavailable
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
    # A torch transfer: the pair whose payloads land here, per layer the
    # leading blocks that landed, set by the done frame (or when the pair's
    # frames end), and what failed it (reported when the transfer finishes).
    pair: PairGroup | None = None
    landed: list[int] | None = None
    payloads_done: asyncio.Event | None = None
    error: Exception | None = None


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
        pair = PairGroup(group, req.group_name)
        old = self.groups.get(req.prefill_worker_id)
        self.groups[req.prefill_worker_id] = pair
        if old is not None:
            old.close()
        if req.preflight_bytes:
            # Queued first on the pair's thread, so it pairs with the sender's
            # preflight before any transfer; the sender times the round trip.
            payload = torch.empty(req.preflight_bytes, dtype=torch.uint8, device=self.io.device)
            ack = torch.ones(1, dtype=torch.uint8, device=self.io.device)

            def drop_and_answer() -> None:
                pair.recv(payload, 0, PREFLIGHT_TAG)
                pair.send(ack, 0, PREFLIGHT_TAG)

            pair.submit(drop_and_answer).add_done_callback(_log_failure("torch preflight"))

    async def receive_frames(self, frames: AsyncIterator[worker_pb2.KVFrame]) -> None:
        """A pair's KVFrames stream: each payload frame's bytes are received
        in the frames' order (the sender sends in that order) and written
        into its transfer's blocks, or dropped if that transfer is no longer
        live. Ends with the pair: its order is lost with the stream, so the
        pair is never used again and its transfers in flight fail."""
        it = aiter(frames)
        first = await anext(it, None)
        if first is None or first.WhichOneof("kind") != "open":
            raise ValueError("a KVFrames stream starts with an open frame")
        sender, name = first.open.prefill_worker_id, first.open.group_name
        pair = self.groups.get(sender)
        if pair is None or pair.broken or pair.name != name:
            raise NotFound(f"no transfer group {name!r} with prefill worker {sender!r}")
        try:
            async for frame in it:
                kind = frame.WhichOneof("kind")
                if kind == "data":
                    await self._payload(pair, frame.data)
                elif kind == "done":
                    r = self._live(pair, frame.done.request_id, frame.done.attempt)
                    if r is not None:
                        r.payloads_done.set()
                else:
                    raise ValueError(f"a {kind} frame after the first")
        finally:
            pair.broken = True
            for r in self.reservations.values():
                if r.pair is pair and not r.payloads_done.is_set():
                    r.error = r.error or Unavailable(
                        f"the KV frames of prefill worker {sender!r} ended")
                    r.payloads_done.set()

    async def _payload(self, pair: PairGroup, p: worker_pb2.KVPayload) -> None:
        num_layers = self.layout.num_layers
        if not 0 < p.num_blocks <= self.io.num_blocks or not -1 <= p.layer < num_layers:
            # Its size is not one this worker can know: the pair is out of step.
            raise ValueError(f"a payload of {p.num_blocks} blocks of layer {p.layer}")
        buf = self.io.empty(num_layers if p.layer < 0 else None, p.num_blocks)
        await pair.run(pair.recv, buf, 0, PAYLOAD_TAG)
        r = self._live(pair, p.request_id, p.attempt)
        if r is None or r.cancelled or r.error is not None:
            return  # abandoned or aborted meanwhile, or already failed: dropped
        try:
            ids = self._slice(r, p.first_block, p.num_blocks)
        except ValueError as exc:
            r.error = exc
            return
        write_local(self.io, ids, None if p.layer < 0 else p.layer, buf)
        for layer in range(num_layers) if p.layer < 0 else (p.layer,):
            if p.first_block <= r.landed[layer]:
                r.landed[layer] = max(r.landed[layer], p.first_block + p.num_blocks)

    def _live(self, pair: PairGroup, request_id: str, attempt: int) -> Reservation | None:
        """The reservation a torch payload of ``pair`` may land in, if any."""
        r = self.reservations.get(request_id)
        if (r is None or r.pair is not pair or r.attempt != attempt or not r.writing
                or r.payloads_done.is_set()):
            return None
        return r

    # ---- mooncake and torch transports: the control stream ---------------------------

    async def receive_writes(self, messages: AsyncIterator[worker_pb2.WriteKVMessage],
                             allowed: Callable[[str], None] = lambda transport: None,
                             ) -> AsyncIterator[worker_pb2.WriteKVReply]:
        """The control half of a mooncake (kv_transfer/mooncake_transport.py)
        or torch (kv_transfer/torch_transport.py) transfer: begin -> ready
        (the reservation is marked as being written), then done -> the
        bytes, once the completion count matches the reservation.
        ``allowed(transport)`` raises if this worker does not take it."""
        it = aiter(messages)
        begin = await anext(it, None)
        if begin is None or begin.WhichOneof("kind") != "begin":
            raise ValueError("a WriteKV transfer starts with a begin message")
        b = begin.begin
        transport = b.transport or "mooncake"
        if transport not in ("mooncake", "torch"):
            raise ValueError(f"WriteKV for transport {transport!r}; mooncake or torch")
        allowed(transport)
        self.layout.check_compatible(KVLayout.from_proto(b.layout), "sender")
        pair = None
        if transport == "torch":
            pair = self.groups.get(b.prefill_worker_id)
            if pair is None or pair.broken:
                raise NotFound(f"no transfer group with prefill worker {b.prefill_worker_id!r}")
        r = self._begin(b.request_id, b.attempt)
        start, finished = time.perf_counter(), False
        try:
            if b.num_blocks != len(r.block_ids):
                raise ValueError(f"{b.num_blocks} blocks announced, {len(r.block_ids)} reserved")
            if pair is not None:
                r.pair, r.landed = pair, [0] * self.layout.num_layers
                r.payloads_done = asyncio.Event()
            yield worker_pb2.WriteKVReply(ready=True)
            done = await anext(it, None)
            if done is None or done.WhichOneof("kind") != "done":
                raise ValueError(f"the {transport} transfer ended before its done message")
            if done.done.num_blocks != len(r.block_ids):
                raise ValueError(f"{done.done.num_blocks} blocks written, "
                                 f"{len(r.block_ids)} reserved")
            expected = [len(r.block_ids)] * self.layout.num_layers
            layers = list(done.done.layer_blocks)
            if pair is not None:
                await r.payloads_done.wait()  # every payload of the transfer has been received
                self._check_live(b.request_id, r)
                if r.error is not None:
                    raise r.error
                layers = r.landed
            if layers and layers != expected:
                raise ValueError(f"written by layer: {layers} blocks; {len(r.block_ids)} in "
                                 f"each of {self.layout.num_layers} layers expected")
            r.bytes_received = (sum(layers) * self.layout.block_bytes_per_layer
                                if pair is not None else done.done.bytes_written)
            received = self._finish(b.request_id, r, transport, start)  # checks the count
            finished = True
        except BaseException:
            if not finished:
                self._abandon(b.request_id, r, transport, start)
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
        r.pair = None  # a torch payload still on its way is dropped
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
