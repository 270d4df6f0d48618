"""KV over gRPC: a client stream of per-layer chunks of raw bytes."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.kv_blocks import KVBlockView
from kv_transfer.base import PREFLIGHT_BYTES, KVSender
from kv_transfer.block_io import to_bytes
from kv_transfer.layout import KVLayout, TransferStats
from kv_transfer.progress import PrefillProgress
from rpc.channel import MAX_MESSAGE_BYTES
from rpc.errors import peer_error
from rpc.pool import ChannelPool
from rpc.protos import worker_pb2, worker_pb2_grpc
from rpc.refusal import send_stream

logger = logging.getLogger("kv_transfer")

CHUNK_BYTES = 4 << 20


class GrpcSender(KVSender):
    name = "grpc"
    streams_during_compute = True

    def __init__(self, io: KVBlockView, layout: KVLayout, channels: ChannelPool) -> None:
        super().__init__()
        self.io = io
        self.layout = layout
        self.channels = channels
        per_block = layout.block_bytes_per_layer
        self.blocks_per_chunk = max(1, min(CHUNK_BYTES, MAX_MESSAGE_BYTES // 2) // per_block)
        self._preflight_locks: dict[str, asyncio.Lock] = {}

    async def send(self, request_id, ticket, src_block_ids) -> TransferStats:
        """All blocks at once: a prefill that is already complete."""
        if len(src_block_ids) != len(ticket.block_ids):
            raise ValueError(
                f"{len(src_block_ids)} source blocks for a ticket of {len(ticket.block_ids)}"
            )

        async def read(lo: int, hi: int):
            # Off the event loop: with tensor parallelism a read waits for
            # the running step and gathers from every rank.
            return await asyncio.get_running_loop().run_in_executor(
                None, self.io.read, src_block_ids[lo:hi])

        progress = PrefillProgress(len(src_block_ids), read)
        progress.complete()
        return await self.send_progressive(request_id, ticket, progress)

    async def send_progressive(self, request_id: str, ticket: worker_pb2.Ticket,
                               progress: PrefillProgress) -> TransferStats:
        """Stream blocks as the prefill computes them: the bytes of early
        chunks travel while later chunks are computed, so only the last
        chunk's KV is left to send when the prompt is done."""
        if progress.total != len(ticket.block_ids):
            raise ValueError(f"{progress.total} blocks to send for a ticket of "
                             f"{len(ticket.block_ids)}")
        await self._first_contact(ticket)
        stub = worker_pb2_grpc.WorkerStub(self.channels.get(ticket.decode_address))
        start = time.perf_counter()
        header = self.layout.to_proto()
        step = self.blocks_per_chunk

        async def chunks():
            sent, first = 0, True
            while sent < progress.total:
                ready = await progress.wait_beyond(sent)
                data = await progress.read(sent, ready)  # [layers, 2, n, ...]
                if data is None:  # preempted since: wait for the recompute
                    continue
                for layer in range(self.layout.num_layers):
                    for lo in range(0, ready - sent, step):
                        piece = data[layer, :, lo : lo + step]
                        yield worker_pb2.KVChunk(
                            request_id=request_id, layout=header if first else None,
                            layer=layer, first_block=sent + lo, num_blocks=piece.shape[1],
                            data=to_bytes(piece), attempt=ticket.attempt,
                        )
                        first = False
                sent = ready

        try:
            reply = await send_stream(stub.PushKV, chunks())
        except grpc.aio.AioRpcError as err:
            raise peer_error(err, f"decode worker {ticket.decode_worker_id}") from None
        return TransferStats("grpc", reply.bytes_received, time.perf_counter() - start)

    async def _first_contact(self, ticket: worker_pb2.Ticket) -> None:
        peer = ticket.decode_worker_id
        if peer in self.bandwidth:
            return
        async with self._preflight_locks.setdefault(peer, asyncio.Lock()):
            if peer in self.bandwidth:
                return
            stub = worker_pb2_grpc.WorkerStub(self.channels.get(ticket.decode_address))
            filler = bytes(CHUNK_BYTES)

            async def chunks():
                for lo in range(0, PREFLIGHT_BYTES, CHUNK_BYTES):
                    yield worker_pb2.PreflightChunk(data=filler[: PREFLIGHT_BYTES - lo])

            start = time.perf_counter()
            try:
                await send_stream(stub.Preflight, chunks(), timeout=30)
            except grpc.aio.AioRpcError as err:
                logger.warning("grpc preflight to %s failed: %s", peer, err.details())
                self.report_preflight(peer, PREFLIGHT_BYTES, None)
                return
            self.report_preflight(peer, PREFLIGHT_BYTES, time.perf_counter() - start)
