"""KV over torch.distributed: gloo on CPU, NCCL on CUDA.

Each prefill/decode pair gets its own two-rank process group, created on
first use and reused: the prefill worker hosts a TCPStore, asks the decode
worker (OpenTransferGroup) to join under a per-pair prefix, and both build
the group. A transfer is an ExpectKV call (the decode side posts a receive
and answers once the bytes are in its blocks) plus one send of all layers.
Transfers of one pair run one at a time, so sends and receives pair up.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kv_transfer.base import KVSender
from kv_transfer.block_io import BlockIO
from kv_transfer.layout import KVLayout, TransferStats
from rpc.pool import ChannelPool
from rpc.protos import worker_pb2, worker_pb2_grpc

TIMEOUT = datetime.timedelta(seconds=30)


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
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kv-pair")
    )
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)


class TorchSender(KVSender):
    name = "torch"

    def __init__(self, io: BlockIO, layout: KVLayout, channels: ChannelPool,
                 worker_id: str, host: str = "127.0.0.1") -> None:
        self.io = io
        self.layout = layout
        self.channels = channels
        self.worker_id = worker_id
        self.host = host
        self._store: dist.TCPStore | None = None
        self._groups: dict[str, PairGroup] = {}
        self._opening = threading.Lock()
        self._open_locks: dict[str, asyncio.Lock] = {}

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            self._store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                        timeout=TIMEOUT)
        return self._store

    async def _pair(self, ticket: worker_pb2.Ticket) -> PairGroup:
        key = ticket.decode_worker_id
        lock = self._open_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self._groups:
                return self._groups[key]
            name = f"kv/{self.worker_id}/{key}/{uuid.uuid4().hex[:8]}"
            prefix = dist.PrefixStore(name, self.store)
            loop = asyncio.get_running_loop()
            building = loop.run_in_executor(None, make_group, prefix, 0, self.io.device)
            stub = worker_pb2_grpc.WorkerStub(self.channels.get(ticket.decode_address))
            try:
                await stub.OpenTransferGroup(worker_pb2.OpenTransferGroupRequest(
                    prefill_worker_id=self.worker_id,
                    store_address=f"{self.host}:{self.store.port}", group_name=name,
                ))
            finally:
                group = await building  # gloo fails by itself after TIMEOUT if the peer never joins
            self._groups[key] = PairGroup(group)
            return self._groups[key]

    async def send(self, request_id, ticket, src_block_ids) -> TransferStats:
        pair = await self._pair(ticket)
        stub = worker_pb2_grpc.WorkerStub(self.channels.get(ticket.decode_address))
        start = time.perf_counter()
        async with pair.lock:
            data = await pair.run(self.io.read, src_block_ids)
            expect = asyncio.ensure_future(stub.ExpectKV(worker_pb2.ExpectKVRequest(
                request_id=request_id, prefill_worker_id=self.worker_id,
                layout=self.layout.to_proto(), num_blocks=len(src_block_ids),
                attempt=ticket.attempt,
            )))
            tag = transfer_tag(request_id)
            try:
                await pair.run(lambda: pair.group.send([data], 1, tag).wait())
            except BaseException:
                expect.cancel()
                raise
            reply = await expect
        return TransferStats("torch", reply.bytes_received, time.perf_counter() - start)


def join_group(store_address: str, group_name: str, device: torch.device):
    """The decode side of ``TorchSender._pair`` (blocking)."""
    host, port = store_address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
    return make_group(dist.PrefixStore(group_name, store), 1, device)
