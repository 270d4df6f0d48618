"""KV over the Mooncake Transfer Engine: one-sided writes into the decode
worker's reserved blocks.

Each worker registers its whole KV cache with a transfer engine once, at
start (``MooncakeEndpoint``). A decode worker's ticket then carries its
engine's address and the base address of every layer's K and V tensor
(``MooncakeTarget``); with the ticket's block ids that is the address of
every reserved block. The prefill worker writes its blocks there itself,
straight from its own cache to the peer's (a batch of (source, destination,
length) segments, consecutive blocks merged; no copy through Python and no
serialization), between the two halves of a ``WriteKV`` stream on the
existing gRPC path: "begin" makes the decode worker mark the reservation as
being written (an abort then waits for the writer), "done" carries the
completion count (bytes and blocks) it checks before the request may start.

Protocol ``tcp`` works anywhere; ``rdma`` needs an RDMA NIC (``device``
names it, e.g. ``mlx5_0``) and is configuration only, not tested here. The
engine's traffic is neither encrypted nor authenticated, and any host that
reaches its port may write into the registered cache: like the torch
transport it is off under TLS unless explicitly allowed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from kv_transfer.base import PREFLIGHT_BYTES, KVSender
from kv_transfer.layout import KVLayout, TransferStats
from rpc.errors import PermissionDenied, Unavailable, peer_error
from rpc.pool import ChannelPool
from rpc.protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger("kv_transfer")

PROTOCOLS = ("tcp", "rdma")
# Longer runs are split: the engine moves segments in parallel (on this 2-core
# loopback 1 MiB pieces moved 64 MiB ~1.8x faster than one 64 MiB segment).
MAX_SEGMENT_BYTES = 1 << 20
# Bounds a transfer's WriteKV stream, so a decode worker that hangs (stopped,
# partitioned) fails the transfer instead of holding the prefill's blocks.
# NOTE: it must exceed any write's duration: the decode worker stops holding
# its blocks for the writer when the stream ends.
TRANSFER_TIMEOUT_S = 120.0
# Most repeats of a transfer's segments a preflight writes to reach PREFLIGHT_BYTES.
MAX_PREFLIGHT_REPEATS = 64


class TransportUnavailable(RuntimeError):
    """A transport could not start on this worker (missing library, no NIC,
    a cache it cannot register): the worker falls back to the next one."""


class MooncakeEndpoint:
    """This worker's transfer engine, with its KV cache registered."""

    def __init__(self, io, host: str, protocol: str = "tcp", device: str = "") -> None:
        if protocol not in PROTOCOLS:
            raise TransportUnavailable(f"mooncake protocol must be one of {PROTOCOLS}, "
                                       f"got {protocol!r}")
        regions_of = getattr(io, "memory_regions", None)
        if regions_of is None:  # a tensor-parallel cache spans processes
            raise TransportUnavailable("the mooncake transport needs the KV cache in this "
                                       "process (no tensor parallelism)")
        try:
            from mooncake.engine import TransferEngine
        except (ImportError, OSError) as exc:  # OSError: libibverbs/librdmacm missing
            raise TransportUnavailable(f"cannot load the mooncake transfer engine: {exc}") \
                from None
        self.regions, self.block_bytes = regions_of()
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise TransportUnavailable(f"the mooncake transfer engine did not start "
                                       f"({protocol} on {host}{' ' + device if device else ''})")
        if protocol == "rdma" and not _rdma_nics(self.engine.get_local_topology()):
            # NOTE: the engine itself would quietly carry on over TCP.
            raise TransportUnavailable("protocol rdma, but the mooncake transfer engine found "
                                       "no RDMA NIC")
        if self.engine.batch_register_memory([a for a, _ in self.regions],
                                             [n for _, n in self.regions]) != 0:
            raise TransportUnavailable("the mooncake transfer engine refused to register "
                                       "the KV cache")
        self.protocol = protocol
        self.rpc_address = f"{host}:{self.engine.get_rpc_port()}"
        # Blocking writes run here, one at a time: the engine batches internally.
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="mooncake")
        logger.info("mooncake transfer engine (%s) at %s: %d KV regions registered", protocol,
                    self.rpc_address, len(self.regions))

    def target(self) -> worker_pb2.MooncakeTarget:
        return worker_pb2.MooncakeTarget(rpc_address=self.rpc_address,
                                         region_addrs=[a for a, _ in self.regions],
                                         block_bytes=self.block_bytes)

    def segments(self, target: worker_pb2.MooncakeTarget, src_block_ids: list[int],
                 dst_block_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(sources, destinations, lengths) moving every layer's K and V of
        ``src_block_ids`` here to ``dst_block_ids`` there; runs of blocks
        consecutive on both sides are one segment, up to MAX_SEGMENT_BYTES."""
        if len(target.region_addrs) != len(self.regions):
            raise ValueError(f"the decode worker registered {len(target.region_addrs)} KV "
                             f"regions, this worker {len(self.regions)}")
        if target.block_bytes != self.block_bytes:
            raise ValueError(f"the decode worker's blocks are {target.block_bytes} bytes per "
                             f"region, this worker's {self.block_bytes}")
        runs: list[tuple[int, int, int]] = []  # (first source, first destination, count)
        for s, d in zip(src_block_ids, dst_block_ids):
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((s, d, 1))
        bb = self.block_bytes
        most = max(1, MAX_SEGMENT_BYTES // bb)
        runs = [(s + i, d + i, min(most, n - i)) for s, d, n in runs for i in range(0, n, most)]
        src, dst, lengths = [], [], []
        for (base, _), remote in zip(self.regions, target.region_addrs):
            for s, d, n in runs:
                src.append(base + s * bb)
                dst.append(remote + d * bb)
                lengths.append(n * bb)
        return src, dst, lengths

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Blocking; raises if any segment failed."""
        if self.engine.batch_transfer_sync_write(peer, src, dst, lengths) != 0:
            raise Unavailable(f"mooncake write of {sum(lengths)} bytes to {peer} failed")

    def close(self) -> None:
        self.thread.shutdown(wait=True)
        self.engine.batch_unregister_memory([a for a, _ in self.regions])


class MooncakeSender(KVSender):
    name = "mooncake"

    def __init__(self, endpoint: MooncakeEndpoint, layout: KVLayout, channels: ChannelPool,
                 worker_id: str) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.layout = layout
        self.channels = channels
        self.worker_id = worker_id

    async def send(self, request_id, ticket, src_block_ids) -> TransferStats:
        if not ticket.HasField("mooncake"):
            raise Unavailable(f"decode worker {ticket.decode_worker_id} does not run the "
                              "mooncake transport")
        if len(src_block_ids) != len(ticket.block_ids):
            raise ValueError(f"{len(src_block_ids)} source blocks for a ticket of "
                             f"{len(ticket.block_ids)}")
        # The peer policy checked decode_address; the engine must be on that host.
        target = ticket.mooncake
        if _host(target.rpc_address) != _host(ticket.decode_address):
            raise PermissionDenied(f"mooncake endpoint {target.rpc_address} is not on the host "
                                   f"of decode worker {ticket.decode_address}")
        segments = self.endpoint.segments(target, src_block_ids, list(ticket.block_ids))
        transfer = asyncio.ensure_future(self._transfer(request_id, ticket, segments))
        try:
            return await asyncio.shield(transfer)
        except asyncio.CancelledError:
            # NOTE: the caller frees the source blocks when this returns: a
            # write in flight must end first (it cannot be interrupted).
            await asyncio.wait([transfer])
            raise

    async def _transfer(self, request_id: str, ticket: worker_pb2.Ticket,
                        segments: tuple[list[int], list[int], list[int]]) -> TransferStats:
        peer = f"decode worker {ticket.decode_worker_id}"
        stub = worker_pb2_grpc.WorkerStub(self.channels.get(ticket.decode_address))
        nbytes = sum(segments[2])
        start = time.perf_counter()
        call = stub.WriteKV(timeout=TRANSFER_TIMEOUT_S)
        try:
            await call.write(worker_pb2.WriteKVMessage(begin=worker_pb2.WriteKVBegin(
                request_id=request_id, prefill_worker_id=self.worker_id,
                layout=self.layout.to_proto(), num_blocks=len(ticket.block_ids),
                attempt=ticket.attempt)))
            reply = await call.read()
            if reply is grpc.aio.EOF or not reply.ready:
                raise Unavailable(f"{peer} did not accept the mooncake write")
            # The blocks are ours to write until "done": measure first contact here.
            await self._first_contact(ticket, segments)
            await self._run(self.endpoint.write, ticket.mooncake.rpc_address, *segments)
            await call.write(worker_pb2.WriteKVMessage(done=worker_pb2.WriteKVDone(
                bytes_written=nbytes, num_blocks=len(ticket.block_ids))))
            await call.done_writing()
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise Unavailable(f"{peer} ended the mooncake transfer without an answer")
        except grpc.aio.AioRpcError as err:
            raise peer_error(err, peer) from None
        except BaseException:
            call.cancel()
            raise
        return TransferStats("mooncake", reply.bytes_received, time.perf_counter() - start)

    async def _first_contact(self, ticket: worker_pb2.Ticket,
                             segments: tuple[list[int], list[int], list[int]]) -> None:
        """The preflight writes this transfer's segments (into its own
        reserved blocks, so nothing else is touched) until PREFLIGHT_BYTES."""
        peer = ticket.decode_worker_id
        if peer in self.bandwidth:
            return
        src, dst, lengths = segments
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


def _rdma_nics(topology: str) -> set[str]:
    """NIC names in the engine's topology JSON ({location: [preferred, available]})."""
    try:
        entries = json.loads(topology)
    except ValueError:
        return set()
    return {nic for lists in entries.values() for names in lists for nic in names}


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")
