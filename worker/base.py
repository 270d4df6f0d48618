"""The common half of every worker."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from engine.async_engine import AsyncEngineLoop
from kv_transfer.block_io import layout_of
from rpc.errors import Draining, Refused, Unimplemented
from rpc.protos import worker_pb2
from rpc.tls import TLSConfig
from worker.metrics import WorkerMetrics
from worker.peers import PeerPolicy
from worker.transports import TransportConfig, Transports

logger = logging.getLogger("worker")


class WorkerBase:
    role = "base"

    def __init__(self, aengine: AsyncEngineLoop, worker_id: str, address: str,
                 metrics: WorkerMetrics | None = None, tls: TLSConfig | None = None,
                 peers: PeerPolicy | None = None,
                 transports: TransportConfig | None = None) -> None:
        """``aengine``: the engine on its thread (with the cores it lends and
        borrows, if any); ``tls``: calls to other workers are mTLS;
        ``peers``: which workers a call may name (worker/peers.py; default:
        any); ``transports``: the KV transports to start
        (worker/transports.py; default grpc)."""
        self.aengine = aengine
        self.engine = engine = aengine.engine
        cores = aengine.cores
        self.worker_id = worker_id
        self.address = address
        self.io = engine.kv_blocks
        self.layout = layout_of(engine)
        self.draining = False
        self.drained = asyncio.Event()  # the drain has ended: multiplexed streams close
        self.metrics = metrics or WorkerMetrics(worker_id, self.role)
        self.metrics.count_from(engine.stats(), cores)
        self.aengine.step_hooks.append(lambda _: self.metrics.observe_engine(engine))
        if cores is not None:
            self.aengine.step_hooks.append(
                lambda _: self.metrics.observe_cores(cores.steps_borrowing, cores.steps_lent))
        # Request id -> the call serving it (a token of its own: an id started
        # again while the old call winds down is the new call's, see ``release``).
        self.inflight: dict[str, object] = {}
        # Requests this worker gave up at shutdown: their streams end with
        # UNAVAILABLE (Draining), not a finish reason, so the gateway moves them.
        self.evicted: set[str] = set()
        self.tls = tls or TLSConfig()
        self.peers = peers or PeerPolicy()
        self.kv_transports = Transports(transports or TransportConfig(), self.io,
                                        self.torch_allowed, self.metrics)

    @property
    def torch_allowed(self) -> bool:
        """The torch and mooncake KV transports neither encrypt nor
        authenticate: under TLS only with ``--tls-allow-torch-transport``."""
        return not self.tls.enabled or self.tls.allow_torch_transport

    def check_torch_allowed(self) -> None:
        if not self.torch_allowed:
            raise Refused("the torch KV transport is off under TLS (it is neither encrypted "
                          "nor authenticated); use the grpc transport, or start the workers "
                          "with --tls-allow-torch-transport on a trusted network")

    def check_accepting(self) -> None:
        if self.draining:
            raise Draining(f"worker {self.worker_id} is draining")

    async def info(self) -> worker_pb2.InfoResponse:
        e, stats = self.engine, self.engine.stats()
        return worker_pb2.InfoResponse(
            worker_id=self.worker_id, role=self.role, model=str(e.config.model or "default"),
            layout=self.layout.to_proto(), num_blocks=stats.num_blocks,
            free_blocks=stats.num_free_blocks, max_model_len=e.max_model_len,
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            transports=self.transports(), draining=self.draining, num_steps=stats.num_steps,
        )

    def transports(self) -> list[str]:
        return []

    # ---- what a role serves ------------------------------------------------------------
    # Each RPC of a role has a default here that answers UNIMPLEMENTED: the
    # servicer calls methods, never names; a role overrides what it serves.

    def _unimplemented(self, rpc: str) -> Unimplemented:
        return Unimplemented(f"a {self.role} worker does not serve {rpc}")

    async def reserve(self, req: worker_pb2.ReserveRequest) -> worker_pb2.Ticket:
        raise self._unimplemented("Reserve")

    async def prefill(self, req: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        raise self._unimplemented("Prefill")

    async def decode(self, req: worker_pb2.DecodeRequest) -> AsyncIterator[worker_pb2.DecodeChunk]:
        raise self._unimplemented("Decode")
        yield  # NOTE: unreachable; makes this an async generator like a role's own

    async def receive_grpc(self, chunks: AsyncIterator[worker_pb2.KVChunk]) -> int:
        raise self._unimplemented("PushKV")

    async def open_group(self, req: worker_pb2.OpenTransferGroupRequest) -> None:
        raise self._unimplemented("OpenTransferGroup")

    async def receive_frames(self, frames: AsyncIterator[worker_pb2.KVFrame]) -> None:
        raise self._unimplemented("KVFrames")

    async def receive_preflight(self, chunks: AsyncIterator[worker_pb2.PreflightChunk]) -> int:
        raise self._unimplemented("Preflight")

    async def receive_writes(self, messages: AsyncIterator[worker_pb2.WriteKVMessage],
                             ) -> AsyncIterator[worker_pb2.WriteKVReply]:
        raise self._unimplemented("WriteKV")
        yield  # NOTE: unreachable; makes this an async generator like a role's own

    async def abort(self, request_id: str) -> bool:
        found = request_id in self.inflight or self.engine.has_request(request_id)
        await self.aengine.abort(request_id)
        return found

    def hold(self, request_id: str) -> object:
        """Count ``request_id`` as in flight; returns the token ``release`` needs."""
        token = self.inflight[request_id] = object()
        return token

    def release(self, request_id: str, token: object) -> None:
        """The call holding ``token`` is over. An id that a newer call holds
        by now (the client started it again at once) stays in flight, and
        stays evicted if the drain evicted it."""
        if self.inflight.get(request_id) is token:
            del self.inflight[request_id]
            self.evicted.discard(request_id)

    def held(self) -> list[str]:
        """Requests this worker still owes an answer or blocks to."""
        return list(self.inflight)

    async def drain(self, grace: float) -> None:
        """Stop taking new work; wait up to ``grace`` seconds for what is in
        flight to finish, then hand the rest back: each still-open stream
        ends with UNAVAILABLE (``Draining``), which the gateway answers by
        migrating it to another worker (prompt + tokens so far), and its
        blocks are freed."""
        self.draining = True
        deadline = time.monotonic() + grace
        while self.held() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in self.held():
            logger.warning("handing %s back at shutdown", request_id)
            self.evicted.add(request_id)
            await self.abort(request_id)
        self.drained.set()

    async def close(self) -> None:
        await self.aengine.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, self.kv_transports.close)
        await self.peers.close()
