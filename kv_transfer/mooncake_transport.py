"""KV over the Mooncake Transfer Engine: one-sided writes into the decode
worker's reserved blocks (kv_transfer/mooncake_endpoint.py has the engine
and the address arithmetic).

The prefill worker writes its blocks into the ticket's blocks itself,
straight from its own cache to the peer's (batches of (source, destination,
length) segments; no copy through Python and no serialization), between the
two halves of a ``WriteKV`` stream on the existing gRPC path: "begin" makes
the decode worker mark the reservation as being written (an abort then
waits for the writer), "done" carries the completion count (bytes, blocks,
and per layer the blocks that landed) it checks before the request may
start. The stream opens when the prompt starts computing, so "begin" and
"ready" (and a first contact's preflight) are over by the time it is done;
then one of two ways to fill the middle:

    send_when     once the prompt is done: one batch of every layer's blocks
    send_layers   while it computes: each layer's final blocks are written as
                  soon as the layer has stored them (kv_transfer/mooncake_layers.py),
                  so the writes overlap the compute of the layers after them
                  (what pays on a GPU, whose compute the writes do not slow;
                  on a CPU they share its cores: docs/benchmarks.md)

The engine's traffic is neither encrypted nor authenticated, and any host
that reaches its port may write into the registered cache: like the torch
transport it is off under TLS unless explicitly allowed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future

from kv_transfer.base import PREFLIGHT_BYTES, KVSender
from kv_transfer.layer_sink import settle
from kv_transfer.layout import KVLayout, TransferStats
from kv_transfer.mooncake_endpoint import MooncakeEndpoint
from kv_transfer.mooncake_layers import LayerWrites
from kv_transfer.write_stream import (
    Written,
    blocks_now,
    guarded,
    source_blocks,
    write_stream,
)
from rpc.errors import PermissionDenied, Unavailable
from rpc.pool import ChannelPool
from rpc.protos import worker_pb2
from rpc.tracing import tracer

logger = logging.getLogger("kv_transfer")
_tracer = tracer("tandem.kv_transfer")
# Most repeats of a transfer's segments a preflight writes to reach PREFLIGHT_BYTES.
MAX_PREFLIGHT_REPEATS = 64


class MooncakeSender(KVSender):
    name = "mooncake"
    sends_by_layer = True

    def __init__(self, endpoint: MooncakeEndpoint, layout: KVLayout, channels: ChannelPool,
                 worker_id: str) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.layout = layout
        self.channels = channels
        self.worker_id = worker_id

    def _check(self, ticket: worker_pb2.Ticket, num_src_blocks: int | None) -> None:
        if not ticket.HasField("mooncake"):
            raise Unavailable(f"decode worker {ticket.decode_worker_id} does not run the "
                              "mooncake transport")
        if num_src_blocks is not None and num_src_blocks != len(ticket.block_ids):
            raise ValueError(f"{num_src_blocks} source blocks for a ticket of "
                             f"{len(ticket.block_ids)}")
        # The peer policy checked decode_address; the engine must be on that host.
        if _host(ticket.mooncake.rpc_address) != _host(ticket.decode_address):
            raise PermissionDenied(f"mooncake endpoint {ticket.mooncake.rpc_address} is not "
                                   f"on the host of decode worker {ticket.decode_address}")

    # ---- one batch of every layer ---------------------------------------------------------

    async def send(self, request_id, ticket, src_block_ids) -> TransferStats:
        self._check(ticket, len(src_block_ids))
        return await self.send_when(request_id, ticket, blocks_now(src_block_ids))

    async def send_when(self, request_id: str, ticket: worker_pb2.Ticket,
                        blocks: asyncio.Future) -> TransferStats:
        """Opens the transfer now (begin, ready, and a first contact's
        preflight run while the prompt computes); once ``blocks`` resolves
        to the source block ids and a CUDA event to wait for (or None: see
        kv_transfer/progress.py ``PromptDone``), writes every layer of them
        in one batch."""
        self._check(ticket, None)
        pending: list[Future] = []

        def write_after(event, peer: str, *segments) -> None:
            if event is not None:
                event.synchronize()
            self.endpoint.write(peer, *segments)

        async def write() -> Written:
            src, event, started = await source_blocks(blocks, ticket)
            segments = self.endpoint.segments(ticket.mooncake, src, list(ticket.block_ids))
            with _tracer.start_as_current_span("kv_transfer.write", attributes={
                    "bytes": sum(segments[2]), "segments": len(segments[2])}):
                pending.append(self.endpoint.thread.submit(
                    write_after, event, ticket.mooncake.rpc_address, *segments))
                await asyncio.wrap_future(pending[-1])
            return ({"bytes_written": sum(segments[2]), "num_blocks": len(ticket.block_ids)},
                    started, {"segments": len(segments[2])})

        async def stop() -> None:
            await settle(pending)

        return await guarded(self._transfer(request_id, ticket, write, stop))

    # ---- layer by layer, during the compute ----------------------------------------------

    def layer_sink(self, request_id: str, ticket: worker_pb2.Ticket, span=None) -> LayerWrites:
        """The engine sink of a transfer by layer (``send_layers``)."""
        self._check(ticket, None)
        return LayerWrites(self.endpoint, ticket.mooncake, list(ticket.block_ids),
                           self.layout.num_layers, span)

    async def send_layers(self, request_id: str, ticket: worker_pb2.Ticket,
                          writes: LayerWrites) -> TransferStats:
        """Opens the transfer now and lets ``writes`` write once the decode
        worker accepts; done once the forward pass that completes the prompt
        has queued its last write and every write has landed."""

        async def write() -> Written:
            started = await writes.sent_all(request_id)
            nbytes = writes.num_blocks * self.layout.block_bytes_per_layer * writes.num_layers
            return ({"bytes_written": nbytes, "num_blocks": writes.num_blocks,
                     "layer_blocks": writes.landed}, started, {"segments": writes.num_segments})

        async def stop() -> None:
            writes.close()
            await writes.settle()

        stats = await guarded(self._transfer(request_id, ticket, write, stop))
        stats.extra["bytes_moved"] = writes.bytes_moved
        return stats

    async def _transfer(self, request_id: str, ticket: worker_pb2.Ticket, write,
                        stop) -> TransferStats:
        return await write_stream(self.channels, self.worker_id, self.layout, "mooncake",
                                  request_id, ticket, write, stop,
                                  lambda: self._first_contact(ticket))

    async def _first_contact(self, ticket: worker_pb2.Ticket) -> None:
        """The preflight writes into this transfer's own reserved blocks (so
        nothing else is touched), from the start of this worker's cache,
        until PREFLIGHT_BYTES."""
        peer = ticket.decode_worker_id
        if peer in self.bandwidth:
            return
        ids = list(ticket.block_ids)
        src, dst, lengths = self.endpoint.segments(ticket.mooncake, list(range(len(ids))), ids)
        repeats = max(1, min(MAX_PREFLIGHT_REPEATS, -(-PREFLIGHT_BYTES // sum(lengths))))
        start = time.perf_counter()
        try:
            await self._run(self.endpoint.write, ticket.mooncake.rpc_address, src * repeats,
                            dst * repeats, lengths * repeats)
        except Exception as exc:
            logger.warning("mooncake preflight to %s failed: %s", peer, exc)
            self.report_preflight(peer, 0, None)
            return
        self.report_preflight(peer, sum(lengths) * repeats, time.perf_counter() - start)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.endpoint.thread, fn, *args)


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")
