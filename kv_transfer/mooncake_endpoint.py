"""This worker's Mooncake transfer engine, with its KV cache registered, and
the batch writes that move blocks into a peer's registered cache.

Each worker registers its whole KV cache with a transfer engine once, at
start. A decode worker's ticket carries its engine's address and the base
address of every layer's K and V tensor (``MooncakeTarget``); with the
ticket's block ids that is the address of every reserved block. A block
``b`` of region ``r`` (layer ``r // 2``, K or V) starts at ``base_r + b *
block_bytes``, so a run of consecutive blocks is one contiguous range per
region: one segment, however many blocks it holds (the block pool hands out
such runs, engine/free_runs.py).

Protocol ``tcp`` works anywhere; ``rdma`` needs an RDMA NIC (``device``
names it, e.g. ``mlx5_0``) and is configuration only, not tested here.

Given ``cores`` (``--mooncake-cores``), the threads the engine starts, and
the one that submits and polls its writes, run there only; by default,
wherever the worker may run. Over TCP each side's engine moves the bytes on
one I/O thread, busy for the whole transfer. Between two bare processes on
this 2-core host, 64 MiB moved at 80% or more of raw loopback TCP's speed
in 1 run of 10 with every thread left to the kernel, in 12 of 17 with each
side's threads on a core of its own. In a served 1P+1D pair on the same two
cores, though, each worker's threads on its own compute core cost a loaded
burst 5% of its output tokens and 16% on its time to first token, and
bought the idle handoff nothing: so that is not the default
(docs/benchmarks.md, twelfth and thirteenth sessions). A spare core beside
a worker's compute cores is what the option is for.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from rpc.errors import Unavailable
from rpc.protos import worker_pb2

logger = logging.getLogger("kv_transfer")

PROTOCOLS = ("tcp", "rdma")
# Longer runs are split. NOTE: with writes polled (``write``), fewer, larger
# segments are faster: on this 2-core loopback 64 MiB in 8 MiB segments moved
# at 90-94% of raw TCP, in 1 MiB ones at 75-84%, in 256 KiB ones at 66-68%.
MAX_SEGMENT_BYTES = 8 << 20

# Mooncake's TCP connections per peer (MC_TCP_LANES_PER_PEER; see MooncakeEndpoint).
TCP_LANES_PER_PEER = 2

# Segments of one write submitted and not yet landed, at most (``write``).
MAX_IN_FLIGHT = 512
# A write's segments still pending after this (plus a second per GiB) fail it.
WRITE_TIMEOUT_S = 30.0
# Polling a write's status: the first nap, doubling up to the longest.
MIN_NAP_S = 50e-6
MAX_NAP_S = 500e-6

Segments = tuple[list[int], list[int], list[int]]  # (sources, destinations, lengths)
Run = tuple[int, int, int]  # (first source block, first destination block, count)


class TransportUnavailable(RuntimeError):
    """A transport could not start on this worker (missing library, no NIC,
    a cache it cannot register): the worker falls back to the next one."""


class MooncakeEndpoint:
    """This worker's transfer engine, with its KV cache registered."""

    def __init__(self, io, host: str, protocol: str = "tcp", device: str = "",
                 cores: Sequence[int] = ()) -> None:
        if protocol not in PROTOCOLS:
            raise TransportUnavailable(f"mooncake protocol must be one of {PROTOCOLS}, "
                                       f"got {protocol!r}")
        regions_of = getattr(io, "memory_regions", None)
        if regions_of is None:  # a tensor-parallel cache spans processes
            raise TransportUnavailable("the mooncake transport needs the KV cache in this "
                                       "process (no tensor parallelism)")
        # Two TCP connections per peer, unless the environment says otherwise
        # (read by the engine when it starts). 64 MiB between two processes
        # on this 2-core loopback, five interleaved runs each: median 1643
        # MiB/s with 2 lanes, 1261 with the default 1 and 1315 with 4
        # (docs/benchmarks.md); for 16 MiB no difference.
        os.environ.setdefault("MC_TCP_LANES_PER_PEER", str(TCP_LANES_PER_PEER))
        try:
            from mooncake.engine import TransferEngine
        except (ImportError, OSError) as exc:  # OSError: libibverbs/librdmacm missing
            raise TransportUnavailable(f"cannot load the mooncake transfer engine: {exc}") \
                from None
        self.regions, self.block_bytes = regions_of()
        self.io = io  # NOTE: the registered memory must outlive the engine
        self.device = io.device
        self.engine = TransferEngine()
        with _threads_started_on(cores):
            started = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device) == 0
        if not started:
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
        # On the engine's cores too, if it has its own (module docstring).
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="mooncake",
                                         initializer=_run_on, initargs=(tuple(cores),))
        logger.info("mooncake transfer engine (%s) at %s: %d KV regions registered", protocol,
                    self.rpc_address, len(self.regions))

    def target(self) -> worker_pb2.MooncakeTarget:
        return worker_pb2.MooncakeTarget(rpc_address=self.rpc_address,
                                         region_addrs=[a for a, _ in self.regions],
                                         block_bytes=self.block_bytes)

    def check_target(self, target: worker_pb2.MooncakeTarget) -> None:
        """ValueError unless the peer's cache is laid out like this one's."""
        if len(target.region_addrs) != len(self.regions):
            raise ValueError(f"the decode worker registered {len(target.region_addrs)} KV "
                             f"regions, this worker {len(self.regions)}")
        if target.block_bytes != self.block_bytes:
            raise ValueError(f"the decode worker's blocks are {target.block_bytes} bytes per "
                             f"region, this worker's {self.block_bytes}")

    def segments(self, target: worker_pb2.MooncakeTarget, src_block_ids: list[int],
                 dst_block_ids: list[int], layers: range | None = None) -> Segments:
        """(sources, destinations, lengths) moving K and V of ``layers``
        (default: all) of ``src_block_ids`` here to ``dst_block_ids`` there;
        runs of blocks consecutive on both sides are one segment per region,
        up to MAX_SEGMENT_BYTES."""
        self.check_target(target)
        return self.place(target, self.runs(src_block_ids, dst_block_ids), layers)

    def runs(self, src_block_ids: list[int], dst_block_ids: list[int]) -> list[Run]:
        """(first source, first destination, count) of each run of block
        pairs consecutive on both sides, none over MAX_SEGMENT_BYTES."""
        return _runs(src_block_ids, dst_block_ids, max(1, MAX_SEGMENT_BYTES // self.block_bytes))

    def place(self, target: worker_pb2.MooncakeTarget, runs: list[Run],
              layers: range | None = None) -> Segments:
        """The segments of ``runs`` in the K and V regions of ``layers``."""
        if layers is None:
            layers = range(len(self.regions) // 2)
        bb = self.block_bytes
        src, dst, lengths = [], [], []
        for r in (2 * layer + kv for layer in layers for kv in (0, 1)):
            base, remote = self.regions[r][0], target.region_addrs[r]
            for s, d, n in runs:
                src.append(base + s * bb)
                dst.append(remote + d * bb)
                lengths.append(n * bb)
        return src, dst, lengths

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Blocking: returns once every segment has landed, raises if any
        failed (after the others are over: none is in flight then, unless
        the deadline passed).

        NOTE: each segment is submitted on its own and their status polled
        with short sleeps, not ``batch_transfer_sync_write``: that one spins
        on the status without pause, a core busy for the whole transfer,
        which on a host whose cores also compute (a CPU worker, or one
        pinned to its share of cores) starves the engine's own I/O thread
        and the model. Measured here: a quarter to a half of the sender's
        CPU time, and faster (docs/benchmarks.md).

        At most MAX_IN_FLIGHT segments are submitted at a time, the next as
        earlier ones land: the engine's TCP lanes refuse segments past
        their queues' room (1980 segments landed here, 3960 did not; a long
        prompt in a fragmented cache has tens of thousands), and after such
        a refusal segments stayed pending for good, every later write
        failing with them."""
        engine = self.engine
        waiting = list(zip(src, dst, lengths))
        waiting.reverse()  # popped from the end: in order
        ids: list[int] = []
        failed = ""
        deadline = time.monotonic() + WRITE_TIMEOUT_S + sum(lengths) / (1 << 30)
        nap = MIN_NAP_S
        while waiting or ids:
            while waiting and len(ids) < MAX_IN_FLIGHT and not failed:
                s, d, n = waiting.pop()
                batch = engine.transfer_submit_write(peer, s, d, n)
                if not 0 < batch < 1 << 63:  # 0, or -1 as an unsigned id: not submitted
                    failed = f"could not submit a segment of {n} bytes"
                else:
                    ids.append(batch)
            if failed:
                waiting.clear()  # the write has failed: what is in flight is let land
            left = []
            for batch in ids:
                status = engine.transfer_check_status(batch)
                if status == 0:
                    left.append(batch)
                elif status < 0:  # -1 failed, -2 timed out
                    failed = failed or f"a segment failed ({status})"
            if left and time.monotonic() > deadline:
                failed = f"{len(left)} segments still pending after the deadline"
                break
            if len(left) == len(ids) and left:
                time.sleep(nap)  # none landed since the last look
                nap = min(nap * 2, MAX_NAP_S)
            else:
                nap = MIN_NAP_S
            ids = left
        if failed:
            raise Unavailable(f"mooncake write of {sum(lengths)} bytes to {peer} failed: "
                              f"{failed}")

    def close(self) -> None:
        self.thread.shutdown(wait=True)
        self.engine.batch_unregister_memory([a for a, _ in self.regions])


def _run_on(cores: Sequence[int]) -> None:
    """The calling thread runs on ``cores`` only (none given, or not on
    Linux: wherever the kernel puts it)."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


@contextlib.contextmanager
def _threads_started_on(cores: Sequence[int]) -> Iterator[None]:
    """The threads this process starts inside the block run on ``cores``
    only (none given, or not on Linux: wherever the kernel puts them)."""
    tasks = "/proc/self/task"
    if not cores or not hasattr(os, "sched_setaffinity") or not os.path.isdir(tasks):
        yield
        return
    before = set(os.listdir(tasks))
    try:
        yield
    finally:
        for tid in set(os.listdir(tasks)) - before:
            with contextlib.suppress(OSError):  # it has ended already
                os.sched_setaffinity(int(tid), cores)


def _rdma_nics(topology: str) -> set[str]:
    """NIC names in the engine's topology JSON ({location: [preferred, available]})."""
    try:
        entries = json.loads(topology)
    except ValueError:
        return set()
    return {nic for lists in entries.values() for names in lists for nic in names}


def _runs(src: list[int], dst: list[int], most: int) -> list[Run]:
    runs: list[Run] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][2] < most and runs[-1][0] + runs[-1][2] == s \
                and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
