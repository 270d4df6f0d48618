"""The WriteKV control stream around a transfer whose bytes move on another
path (mooncake's one-sided writes, torch's payloads over the pair's process
group): begin -> ready, the bytes, done -> the decode worker's answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

from kv_transfer.layout import KVLayout, TransferStats
from rpc.errors import Unavailable, peer_error
from rpc.pool import ChannelPool
from rpc.protos import worker_pb2, worker_pb2_grpc

# Bounds a transfer's WriteKV stream past the reservation's lease, so a
# decode worker that hangs (stopped, partitioned) fails the transfer instead
# of holding the prefill's blocks. NOTE: it must exceed any send's
# duration: the decode worker stops holding its blocks for the sender when
# the stream ends.
TRANSFER_TIMEOUT_S = 120.0

# What a transfer's ``write`` returns: the done message's fields, when the
# KV was ready to go (perf_counter), and extra stats.
Written = tuple[dict, float, dict]


async def write_stream(channels: ChannelPool, worker_id: str, layout: KVLayout, transport: str,
                       request_id: str, ticket: worker_pb2.Ticket,
                       write: Callable[[], Awaitable[Written]],
                       stop: Callable[[], Awaitable[None]],
                       accepted: Callable[[], Awaitable[None]] | None = None) -> TransferStats:
    """The stream around ``write()``, which moves the bytes once the decode
    worker is ready. The stats' seconds run from when the KV was ready (the
    stream opens with the prompt) to the acknowledgement. On any failure
    ``stop()`` runs before the stream closes: the decode worker stops holding
    its blocks for us once it has, so no send may still be running then.
    ``accepted()``: run once the blocks are ours to write (a first contact's
    preflight)."""
    peer = f"decode worker {ticket.decode_worker_id}"
    stub = worker_pb2_grpc.WorkerStub(channels.get(ticket.decode_address))
    call = stub.WriteKV(timeout=_stream_timeout(ticket))
    try:
        await call.write(worker_pb2.WriteKVMessage(begin=worker_pb2.WriteKVBegin(
            request_id=request_id, prefill_worker_id=worker_id, layout=layout.to_proto(),
            num_blocks=len(ticket.block_ids), attempt=ticket.attempt, transport=transport)))
        reply = await call.read()
        if reply is grpc.aio.EOF or not reply.ready:
            raise Unavailable(f"{peer} did not accept the {transport} transfer")
        if accepted is not None:
            await accepted()
        done, start, extra = await write()
        await call.write(worker_pb2.WriteKVMessage(done=worker_pb2.WriteKVDone(**done)))
        await call.done_writing()
        reply = await call.read()
        if reply is grpc.aio.EOF:
            raise Unavailable(f"{peer} ended the {transport} transfer without an answer")
    except BaseException as exc:
        await asyncio.shield(stop())
        call.cancel()
        if isinstance(exc, grpc.aio.AioRpcError):
            raise peer_error(exc, peer) from None
        raise
    return TransferStats(transport, reply.bytes_received, time.perf_counter() - start, extra)


def blocks_now(src_block_ids: list[int]) -> asyncio.Future:
    """What ``send_when`` takes, for blocks already computed: resolved."""
    blocks = asyncio.get_running_loop().create_future()
    blocks.set_result((list(src_block_ids), None))
    return blocks


async def source_blocks(blocks: asyncio.Future, ticket: worker_pb2.Ticket,
                        ) -> tuple[list[int], object, float]:
    """A ``send_when``'s source blocks, once ready: their ids, the CUDA event
    to wait for (or None), and when they were ready (perf_counter)."""
    src, event = await blocks
    started = time.perf_counter()
    if len(src) != len(ticket.block_ids):
        raise ValueError(f"{len(src)} source blocks for a ticket of {len(ticket.block_ids)}")
    return src, event, started


async def guarded(transfer_coro) -> TransferStats:
    """Run a transfer; cancelled, it is cancelled too, and this returns
    only once it is over (its ``stop`` waits for the sends in flight).
    NOTE: the caller frees the source blocks when this returns."""
    transfer = asyncio.ensure_future(transfer_coro)
    try:
        return await asyncio.shield(transfer)
    except asyncio.CancelledError:
        transfer.cancel()
        await asyncio.wait([transfer])
        raise


def _stream_timeout(ticket: worker_pb2.Ticket) -> float:
    """The reservation's remaining lease (a layer-by-layer transfer is open
    while the prompt computes) plus TRANSFER_TIMEOUT_S."""
    left = ticket.lease_expiry_unix_ms / 1000 - time.time() if ticket.lease_expiry_unix_ms else 0
    return max(left, 0.0) + TRANSFER_TIMEOUT_S
