"""KV over torch.distributed: gloo on CPU, NCCL on CUDA.

Each prefill/decode pair gets its own two-rank process group, created on
first use and reused: the prefill worker hosts a TCPStore, asks the decode
worker (OpenTransferGroup) to join under a per-pair prefix, and both build
the group; a preflight then times a payload over it. A transfer is an
ExpectKV call (the decode side posts a receive and answers once the bytes
are in its blocks) plus one send of all layers. Transfers of one pair run
one at a time, so sends and receives pair up.

Invariant: every send is matched by a receive. An unmatched gloo operation
waits for the timeout and then closes the pair for every later transfer, so
(1) once the prefill side has read the blocks, the transfer runs to its end
even if the caller is cancelled, and (2) a decode worker that refuses the
KV still receives the bytes (and drops them). A pair that fails anyway is
marked broken and replaced on next use.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from engine.kv_blocks import KVBlockView
from engine.openmp import serial_thread
from engine.parallel.store import listening_store
from kv_transfer.base import PREFLIGHT_BYTES, KVSender
from kv_transfer.layout import KVLayout, TransferStats
from rpc.errors import peer_error
from rpc.pool import ChannelPool
from rpc.protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger("kv_transfer")

TIMEOUT = datetime.timedelta(seconds=30)
PREFLIGHT_TAG = 0x7FFFFFFF  # first operation on a fresh pair: no transfer is in flight
# How long a sender waits for its send after the decode worker refused the KV:
# the refusal arrives once the dropped bytes are in, so this is only slack.
REFUSED_SEND_WAIT_S = 5.0


def transfer_tag(request_id: str) -> int:
    """Both sides derive the message tag from the request id, so a send can
    never be matched with another request's receive."""
    return zlib.crc32(request_id.encode()) & 0x7FFFFFFF


def make_group(store: dist.Store, rank: int, device: torch.device):
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)


@dataclass
class PairGroup:
    """One end of a prefill/decode pair's process group."""

    group: object
    # Blocking send/recv calls run here, one at a time, in order.
    thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kv-pair",
                                           initializer=serial_thread)
    )
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    broken: bool = False  # an operation failed: gloo has closed the pair

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.thread, self._guard, fn,
                                                                args)

    def submit(self, fn, *args):
        """Queue ``fn`` on the pair's thread without waiting (after whatever is queued)."""
        return self.thread.submit(self._guard, fn, args)

    def _guard(self, fn, args):
        try:
            return fn(*args)
        except BaseException:
            self.broken = True
            raise

    def send(self, t: torch.Tensor, peer: int, tag: int) -> None:
        self.group.send([_as_bytes(t)], peer, tag).wait()

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> None:
        self.group.recv([_as_bytes(t)], peer, tag).wait()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor (an fp8 KV cache's) as uint8, which every backend
    sends (gloo has no fp8 type); the same memory, so a receive lands in ``t``."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


class TorchSender(KVSender):
    name = "torch"

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

    async def _pair(self, ticket: worker_pb2.Ticket) -> PairGroup:
        key = ticket.decode_worker_id
        lock = self._open_locks.setdefault(key, asyncio.Lock())
        async with lock:
            pair = self._groups.get(key)
            if pair is not None and not pair.broken:
                return pair
            if pair is not None:
                logger.warning("transfer group with %s is broken: opening a new one", key)
                pair.thread.shutdown(wait=False)
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
            pair = self._groups[key] = PairGroup(group)
            await self._preflight(pair, key)
            return pair

    async def _preflight(self, pair: PairGroup, peer: str) -> None:
        """The decode worker queued the matching receive and a one-byte answer
        when it joined (``KVReceiver.open_group``)."""
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
            return
        self.report_preflight(peer, PREFLIGHT_BYTES, seconds)

    async def send(self, request_id, ticket, src_block_ids) -> TransferStats:
        pair = await self._pair(ticket)
        transfer = asyncio.ensure_future(self._transfer(pair, request_id, ticket, src_block_ids))
        try:
            return await asyncio.shield(transfer)
        except asyncio.CancelledError:
            # NOTE: the caller frees the source blocks when this returns, and an
            # abandoned half of a send/receive pair would break the pair: let
            # the transfer finish (gloo's timeout bounds it) before unwinding.
            await asyncio.wait([transfer])
            raise

    async def _transfer(self, pair: PairGroup, request_id: str, ticket: worker_pb2.Ticket,
                        src_block_ids: list[int]) -> TransferStats:
        peer = f"decode worker {ticket.decode_worker_id}"
        stub = worker_pb2_grpc.WorkerStub(self.channels.get(ticket.decode_address))
        tag = transfer_tag(request_id)
        async with pair.lock:
            start = time.perf_counter()
            data = await pair.run(self.io.read, src_block_ids)
            expect = asyncio.ensure_future(stub.ExpectKV(worker_pb2.ExpectKVRequest(
                request_id=request_id, prefill_worker_id=self.worker_id,
                layout=self.layout.to_proto(), num_blocks=len(src_block_ids),
                attempt=ticket.attempt,
            )))
            sending = asyncio.ensure_future(pair.run(pair.send, data, 1, tag))
            await asyncio.wait([expect, sending], return_when=asyncio.FIRST_EXCEPTION)
            if expect.done() and expect.exception() is not None:
                # A refusing decode worker drops the bytes, so the send ends too;
                # if it does not, the pair is unusable: open a new one next time.
                done, _ = await asyncio.wait([sending], timeout=REFUSED_SEND_WAIT_S)
                if not done:
                    pair.broken = True
                    sending.add_done_callback(lambda f: f.exception())
                err = expect.exception()
                if isinstance(err, grpc.aio.AioRpcError):
                    raise peer_error(err, peer) from None
                raise err
            if sending.exception() is not None:
                # gloo failed (and closed the pair): the receive fails as well.
                expect.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise sending.exception()
            try:
                reply = await expect
            except grpc.aio.AioRpcError as err:
                raise peer_error(err, peer) from None
        return TransferStats("torch", reply.bytes_received, time.perf_counter() - start)


def join_group(store_address: str, group_name: str, device: torch.device):
    """The decode side of ``TorchSender._pair`` (blocking)."""
    host, port = store_address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
    return make_group(dist.PrefixStore(group_name, store), 1, device)
