"""KV over torch.distributed: gloo on CPU, NCCL on CUDA.

Each prefill/decode pair gets its own two-rank process group
(kv_transfer/torch_pair.py), created on first use and reused: the prefill
worker hosts a TCPStore, asks the decode worker (OpenTransferGroup) to join
under a per-pair prefix, and both build the group; a preflight then times a
payload over it, and the prefill worker opens the pair's KVFrames stream.

Every payload of the pair is announced on that stream before it is sent
(kv_transfer/torch_frames.py), and the decode worker receives in the
frames' order: NCCL, which pairs sends and receives by their order, and
gloo agree on which bytes are which, while the transfers of many requests,
each streaming layer by layer as its prompt computes, share the pair. A
transfer's control is a WriteKV stream (kv_transfer/write_stream.py):
nothing is sent before the decode worker is ready, so a refused transfer
sends nothing; the decode worker checks what landed, per layer, before the
request may start.

Invariant: every announced payload is sent and received (dropped, if its
transfer was abandoned meanwhile). An unmatched operation waits for gloo's
timeout and then closes the pair; a pair that fails is marked broken and
replaced on next use, and its transfers in flight fail.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
import torch
import torch.distributed as dist

from engine.kv_blocks import KVBlockView
from engine.parallel.store import listening_store
from kv_transfer.base import PREFLIGHT_BYTES, KVSender
from kv_transfer.layer_sink import settle
from kv_transfer.layout import KVLayout, TransferStats
from kv_transfer.torch_frames import FrameChannel, done_frame, payload_frame
from kv_transfer.torch_layers import LayerSends
from kv_transfer.torch_pair import PREFLIGHT_TAG, TIMEOUT, PairGroup, make_group
from kv_transfer.write_stream import (
    Written,
    blocks_now,
    guarded,
    source_blocks,
    write_stream,
)
from rpc.errors import Unavailable, peer_error
from rpc.pool import ChannelPool
from rpc.protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger("kv_transfer")


class TorchSender(KVSender):
    name = "torch"
    sends_by_layer = True

    def __init__(self, io: KVBlockView, layout: KVLayout, channels: ChannelPool,
                 worker_id: str, host: str = "127.0.0.1", bind_host: str | None = None) -> None:
        """``host``: where decode workers reach this worker's store;
        ``bind_host``: the address the store listens on (default ``host``)."""
        super().__init__()
        self.io = io
        self.layout = layout
        self.channels = channels
        self.worker_id = worker_id
        self.host = host
        self.bind_host = bind_host or host
        self._store: dist.TCPStore | None = None
        self._groups: dict[str, PairGroup] = {}
        self._open_locks: dict[str, asyncio.Lock] = {}

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            self._store = listening_store(self.bind_host, TIMEOUT)
        return self._store

    # ---- the pair ------------------------------------------------------------------------

    async def _pair(self, ticket: worker_pb2.Ticket) -> PairGroup:
        key = ticket.decode_worker_id
        lock = self._open_locks.setdefault(key, asyncio.Lock())
        async with lock:
            pair = self._groups.get(key)
            if pair is not None and not pair.broken:
                return pair
            if pair is not None:
                logger.warning("transfer group with %s is broken: opening a new one", key)
                pair.close()
                del self._groups[key]
            name = f"kv/{self.worker_id}/{key}/{uuid.uuid4().hex[:8]}"
            prefix = dist.PrefixStore(name, self.store)
            loop = asyncio.get_running_loop()
            building = loop.run_in_executor(None, make_group, prefix, 0, self.io.device)
            stub = worker_pb2_grpc.WorkerStub(self.channels.get(ticket.decode_address))
            try:
                await stub.OpenTransferGroup(worker_pb2.OpenTransferGroupRequest(
                    prefill_worker_id=self.worker_id,
                    store_address=f"{self.host}:{self.store.port}", group_name=name,
                    preflight_bytes=PREFLIGHT_BYTES,
                ))
            except grpc.aio.AioRpcError as err:
                raise peer_error(err, f"decode worker {key}") from None
            finally:
                group = await building  # gloo fails by itself after TIMEOUT if the peer never joins
            pair = PairGroup(group, name)
            call = None
            try:
                failure = await self._preflight(pair, key)
                if pair.broken:  # the pair cannot carry anything: say why now
                    raise Unavailable(f"the transfer group with decode worker {key} failed "
                                      f"its preflight: {failure}")
                call = stub.KVFrames()
                await call.write(worker_pb2.KVFrame(open=worker_pb2.KVFramesOpen(
                    prefill_worker_id=self.worker_id, group_name=name)))
            except BaseException as exc:  # cancelled included: nothing of the pair may linger
                pair.close()
                if call is not None:
                    call.cancel()
                if isinstance(exc, grpc.aio.AioRpcError):
                    raise peer_error(exc, f"decode worker {key}") from None
                raise
            pair.channel = FrameChannel(pair, call, f"decode worker {key}")
            self._groups[key] = pair
            return pair

    async def _preflight(self, pair: PairGroup, peer: str) -> Exception | None:
        """The decode worker queued the matching receive and a one-byte answer
        when it joined (``KVReceiver.open_group``). Returns how it failed, if
        it did (then the pair is broken)."""
        payload = torch.zeros(PREFLIGHT_BYTES, dtype=torch.uint8, device=self.io.device)
        ack = torch.empty(1, dtype=torch.uint8, device=self.io.device)

        def exchange() -> float:
            start = time.perf_counter()
            pair.send(payload, 1, PREFLIGHT_TAG)
            pair.recv(ack, 1, PREFLIGHT_TAG)
            return time.perf_counter() - start

        try:
            seconds = await pair.run(exchange)
        except Exception as exc:
            logger.warning("torch preflight to %s failed: %s", peer, exc)
            self.report_preflight(peer, PREFLIGHT_BYTES, None)
            return exc
        self.report_preflight(peer, PREFLIGHT_BYTES, seconds)
        return None

    # ---- every layer in one payload ---------------------------------------------------------

    async def send(self, request_id, ticket, src_block_ids) -> TransferStats:
        return await self.send_when(request_id, ticket, blocks_now(src_block_ids))

    async def send_when(self, request_id: str, ticket: worker_pb2.Ticket,
                        blocks: asyncio.Future) -> TransferStats:
        """Opens the transfer now; once ``blocks`` resolves to the source
        block ids and a CUDA event to wait for (or None: see
        kv_transfer/progress.py ``PromptDone``), sends every layer of them
        as one payload."""
        pair = await self._pair(ticket)
        sending = []

        async def write() -> Written:
            src, event, started = await source_blocks(blocks, ticket)

            def read():
                if event is not None:  # on the pair's stream (torch_pair.py): no host wait
                    torch.cuda.current_stream().wait_event(event)
                return self.io.read(src)

            frame = payload_frame(request_id, ticket.attempt, -1, 0, len(src))
            sending.append(pair.channel.post(frame, read))
            sending.append(pair.channel.post(done_frame(request_id, ticket.attempt)))
            nbytes = await asyncio.wrap_future(sending[0])
            return {"bytes_written": nbytes, "num_blocks": len(src)}, started, {}

        async def stop() -> None:
            await settle(sending)

        return await guarded(write_stream(self.channels, self.worker_id, self.layout, "torch",
                                          request_id, ticket, write, stop))

    # ---- layer by layer, during the compute ----------------------------------------------

    def layer_sink(self, request_id: str, ticket: worker_pb2.Ticket, span=None) -> LayerSends:
        """The engine sink of a transfer by layer (``send_layers``)."""
        return LayerSends(self.io, request_id, ticket.attempt, len(ticket.block_ids),
                          self.layout.num_layers, span)

    async def send_layers(self, request_id: str, ticket: worker_pb2.Ticket,
                          sends: LayerSends) -> TransferStats:
        """Opens the transfer now and lets ``sends`` send once the decode
        worker accepts; done once the forward pass that completes the prompt
        has posted its last layer and the decode worker has every block."""
        try:
            pair = await self._pair(ticket)
        except BaseException:
            sends.close()  # or the engine holds every layer's send for nobody
            raise

        def done() -> None:  # after every payload posted: the done frame follows them
            sends.futures.append(pair.channel.post(done_frame(request_id, ticket.attempt)))

        async def write() -> Written:
            sends.channel = pair.channel
            started = await sends.sent_all(request_id, done)
            return ({"bytes_written": sends.bytes_moved, "num_blocks": sends.num_blocks,
                     "layer_blocks": sends.landed}, started, {})

        async def stop() -> None:
            sends.close()
            await sends.settle()

        stats = await guarded(write_stream(self.channels, self.worker_id, self.layout, "torch",
                                           request_id, ticket, write, stop))
        stats.extra["bytes_moved"] = sends.bytes_moved
        return stats

    async def close(self) -> None:
        for pair in self._groups.values():
            pair.close()
        self._groups.clear()
