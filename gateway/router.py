"""Which workers exist, how loaded they are, and which to use for a request.

Workers come from configuration and from registration in the state store
(``tandem:worker:*`` keys with a heartbeat TTL). Every worker is polled with
``Info``; one that stops answering, or whose registration expires, leaves
rotation until it answers again. A worker serving a different model than the
gateway's is refused with a logged error and never routed to.

Decode first: the decode worker with the most free blocks that can hold the
request. Then the prefill worker: the one the prompt's first block hashes to
(rendezvous hashing, so repeated prefixes land where they are cached),
unless its queue is clearly longer than the shortest, and never one kept
apart from that decode worker after failed handoffs (``pairs``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

import grpc

from engine.config import DTYPE_SIZES
from gateway.decode_mux import DecodeMux, MuxedDecode, open_mux
from gateway.pair_health import PairHealth
from rpc.errors import Unavailable
from rpc.pool import ChannelPool
from rpc.protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger("gateway")

POLL_S = 0.5
# A registered worker whose record is missing stays known this long: a Redis
# that restarted empty has every record back within a heartbeat (1 s), and a
# worker that died is out of rotation anyway, by its failing polls.
MISSING_RECORD_GRACE_S = 3.0
# Prefix affinity yields to load when the preferred worker's queue is longer
# than the shortest by more than this.
AFFINITY_SLACK = 4


@dataclass
class WorkerView:
    address: str
    role: str = ""
    worker_id: str = ""
    free_blocks: int = 0
    num_blocks: int = 0
    block_size: int = 16
    kv_bytes_per_token: int = 0  # K and V of every layer, from its KV layout
    num_running: int = 0
    num_waiting: int = 0
    healthy: bool = False
    refused: str = ""  # why the gateway will not use it
    draining: bool = False
    registered: bool = False  # found in the state store rather than configured
    missing_since: float = 0.0  # when its registration was last found missing
    inflight: int = 0  # requests this gateway has on it now
    last_seen: float = 0.0
    # Liveness beyond "answers Info": the engine's step counter, when it last
    # grew, and the seconds per step it grew at while busy (stall.py).
    num_steps: int = 0
    stepped_at: float = 0.0
    step_s: float = 0.0
    # Set when the worker leaves rotation (stops answering, stops heartbeating,
    # refused); replaced by a fresh event when it comes back. Streams on it
    # watch the event they started with, and move.
    left: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def usable(self) -> bool:
        return self.healthy and not self.refused and not self.draining

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting + self.inflight


@dataclass
class WorkerPool:
    channels: ChannelPool
    fingerprint: str | None
    static: list[str] = field(default_factory=list)
    registry_url: str | None = None
    workers: dict[str, WorkerView] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for address in self.static:
            self.workers[address] = WorkerView(address)
        self._task: asyncio.Task | None = None
        self._decodes: dict[str, DecodeMux] = {}
        self._stopped = False
        self._closing: set[asyncio.Task] = set()
        self._redis = None
        self.pairs = PairHealth()
        self.changed = asyncio.Event()
        # Tokens the largest decode worker's whole KV cache holds, as last
        # polled (0: none polled yet); read from the tokenizer threads too.
        self.largest_decode_cache = 0

    async def start(self) -> None:
        if self.registry_url:
            import redis.asyncio as redis

            self._redis = redis.from_url(self.registry_url, decode_responses=True,
                                         socket_timeout=1.0, socket_connect_timeout=1.0)
        await self.refresh()
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
        await asyncio.gather(*(mux.close() for mux in self._decodes.values()), *self._closing)
        self._decodes.clear()
        if self._redis is not None:
            await self._redis.aclose()

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channels.get(address))

    def decode(self, address: str, request: worker_pb2.DecodeRequest) -> MuxedDecode:
        """Start ``request`` on the decode worker at ``address``, over the
        one stream this gateway keeps open to it."""
        if self._stopped:
            raise Unavailable("the gateway is shutting down")
        mux = self._decodes.get(address)
        if mux is None or mux.closed:
            mux = self._decodes[address] = open_mux(self.stub(address), address)
        return mux.start(request)

    def _close_decodes(self, address: str) -> None:
        mux = self._decodes.pop(address, None)
        if mux is not None:
            self._closing.add(task := asyncio.ensure_future(mux.close()))
            task.add_done_callback(self._closing.discard)

    # ---- discovery and health ----------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.refresh()
            except Exception:
                logger.exception("worker refresh failed")

    async def refresh(self) -> None:
        if self._redis is not None:
            try:
                await self._discover()
            except Exception as exc:  # the registry is down: keep the workers known so far
                logger.warning("worker registry unreachable (%s): keeping %d known workers",
                               exc, len(self.workers))
        await asyncio.gather(*(self._poll(w) for w in list(self.workers.values())))
        caches = [w.num_blocks * w.block_size for w in self.decode_workers()]
        if caches:  # none in rotation now: keep the last known
            self.largest_decode_cache = max(caches)
        self.changed.set()

    async def _discover(self) -> None:
        seen = set()
        async for key in self._redis.scan_iter(match="tandem:worker:*"):
            raw = await self._redis.get(key)
            if raw is None:
                continue
            record = json.loads(raw)
            seen.add(record["address"])
            if record["address"] not in self.workers:
                logger.info("discovered %s worker %s at %s", record["role"],
                            record["worker_id"], record["address"])
                self.workers[record["address"]] = WorkerView(record["address"], registered=True)
        now = time.monotonic()
        for address, w in list(self.workers.items()):
            if not w.registered:
                continue
            if address in seen:
                w.missing_since = 0.0
            elif not w.missing_since:
                w.missing_since = now
            elif now - w.missing_since > MISSING_RECORD_GRACE_S:
                logger.info("worker %s stopped heartbeating: out of rotation", address)
                w.left.set()
                del self.workers[address]
                self.pairs.forget(address)
                self._close_decodes(address)

    async def _poll(self, w: WorkerView) -> None:
        try:
            info = await self.stub(w.address).Info(worker_pb2.InfoRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            if w.healthy:
                logger.warning("worker %s is not answering: out of rotation", w.address)
            w.healthy = False
            w.left.set()
            return
        _observe_steps(w, info.num_steps, busy=w.num_running > 0)
        w.role, w.worker_id = info.role, info.worker_id
        w.free_blocks, w.num_blocks = info.free_blocks, info.num_blocks
        w.block_size = info.layout.block_size or 16
        lay = info.layout
        w.kv_bytes_per_token = (2 * lay.num_layers * lay.num_kv_heads * lay.head_dim
                                * DTYPE_SIZES.get(lay.dtype, 2))
        w.num_running, w.num_waiting = info.num_running, info.num_waiting
        w.draining = info.draining
        w.healthy, w.last_seen = True, time.monotonic()
        fp = info.layout.model_fingerprint
        if self.fingerprint and fp != self.fingerprint and not w.refused:
            w.refused = (f"serves model fingerprint {fp}, the gateway's model is "
                         f"{self.fingerprint}")
            logger.error("refusing worker %s (%s): %s", w.worker_id, w.address, w.refused)
        if w.refused:
            w.left.set()
        elif w.left.is_set():  # back in rotation: streams from now on watch a new event
            w.left = asyncio.Event()

    # ---- choosing ------------------------------------------------------------------------

    def usable(self, roles: tuple[str, ...]) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.usable and w.role in roles]

    @property
    def colocated(self) -> bool:
        """No prefill workers: 'both' workers serve whole requests."""
        return not self.usable(("prefill",)) and bool(self.usable(("both",)))

    def decode_workers(self) -> list[WorkerView]:
        """The workers in rotation that can take a request's decode."""
        return self.usable(("both",) if self.colocated else ("decode", "both"))

    def decode_candidates(self, num_tokens: int, tried: set[str],
                          exclude: set[str] = frozenset()) -> list[WorkerView]:
        """Every decode worker whose whole cache can hold ``num_tokens``
        (``exclude`` left out), in the order to ask them: room by the last
        poll first, then untried before tried, then most free blocks, then
        least loaded.

        The polled free counts only order the list: they lag behind requests
        that finished since the poll, and a worker's Reserve answer decides.
        """
        fits = [w for w in self.decode_workers()
                if w.num_blocks * w.block_size >= num_tokens and w.address not in exclude]

        def order(w: WorkerView):
            room = w.free_blocks * w.block_size >= num_tokens
            return (not room, w.address in tried, -w.free_blocks, w.load)

        return sorted(fits, key=order)

    def pick_prefill(self, prompt: list[int], exclude: set[str],
                     decode: str | None = None) -> WorkerView | None:
        """The prefill worker for ``prompt`` (``exclude`` left out, and those
        kept apart from ``decode``: gateway/pair_health.py)."""
        candidates = [w for w in self.usable(("prefill",)) if w.address not in exclude
                      and (decode is None or not self.pairs.apart(w.address, decode))]
        if not candidates:
            return None
        prefix = prompt[: candidates[0].block_size]
        key = hashlib.sha256(",".join(map(str, prefix)).encode()).digest()

        def affinity(w: WorkerView) -> bytes:
            return hashlib.sha256(key + w.address.encode()).digest()

        preferred = max(candidates, key=affinity)
        least = min(w.load for w in candidates)
        if preferred.load <= least + AFFINITY_SLACK:
            return preferred
        return min(candidates, key=lambda w: (w.load, affinity(w)))

    def snapshot(self) -> list[dict]:
        return [
            {"address": w.address, "role": w.role, "worker_id": w.worker_id,
             "healthy": w.healthy, "refused": w.refused, "free_blocks": w.free_blocks,
             "load": w.load}
            for w in self.workers.values()
        ]


def _observe_steps(w: WorkerView, num_steps: int, busy: bool) -> None:
    """Note a poll's step counter: when it grew, and (over a poll interval
    in which the worker was busy) how long its steps take."""
    now = time.monotonic()
    if num_steps == w.num_steps:
        return
    if busy and w.last_seen and num_steps > w.num_steps:
        per_step = (now - w.last_seen) / (num_steps - w.num_steps)
        w.step_s = per_step if not w.step_s else 0.8 * w.step_s + 0.2 * per_step
    w.num_steps, w.stepped_at = num_steps, now
