"""One request's KV written into a decode worker's blocks layer by layer,
while its prompt still computes (the engine's ``LayerKVSink``).

On the engine thread, as layer ``i`` of a step has stored its KV, the blocks
that became final in that layer are planned as segments and queued on the
endpoint's writer thread; the write of layer ``i`` then runs while layer
``i + 1`` computes::

    engine thread    | layer 0 | layer 1 | layer 2 | ...  | layer L-1 |
    writer thread         [w 0]     [w 1]     [w 2]   ...        [w L-1] -> done

Writes are held back until the decode worker has accepted the transfer
(``start``): no byte lands in its blocks before the reservation is marked
as being written. NOTE: held here, not queued on the writer thread to wait
there: a queued write that waits would hold up every other request's
writes (and the first contact's preflight) behind a slow decode worker.
Each layer counts the leading blocks that landed (``landed``): the
completion count the decode worker checks. After a preemption the prompt
is computed again into other blocks and every layer is sent again; writes
of one endpoint run in order, so the last write of a block is the good one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import torch
from opentelemetry import trace

from kv_transfer.mooncake_endpoint import MooncakeEndpoint, Run, Segments
from kv_transfer.progress import resolve_once
from rpc.protos import worker_pb2
from rpc.tracing import tracer

_tracer = tracer("tandem.kv_transfer")


class LayerWrites:
    def __init__(self, endpoint: MooncakeEndpoint, target: worker_pb2.MooncakeTarget,
                 dst_block_ids: list[int], num_layers: int, span=None) -> None:
        """``span``: the transfer's span, parent of one span per layer write.
        Create it on the event loop: ``queued`` resolves there once the step
        that completes the prompt has queued its last layer's write (before
        that step's sampling)."""
        endpoint.check_target(target)
        self.endpoint = endpoint
        self.target = target
        self.dst = list(dst_block_ids)
        self.num_layers = num_layers
        self.sent = [0] * num_layers  # per layer, leading blocks queued
        self.landed = [0] * num_layers  # per layer, leading blocks written
        self.bytes_moved = 0
        self.num_segments = 0
        self.futures: list[Future] = []  # the writes handed to the writer thread
        self.loop = asyncio.get_running_loop()
        self.queued: asyncio.Future = self.loop.create_future()
        self._held: list[tuple] = []  # writes planned before ``start``
        self._lock = threading.Lock()  # the engine thread plans, the event loop starts
        self._started = False
        self.closed = False  # no more writes (the transfer failed or was cancelled)
        recording = span is not None and span.is_recording()
        self._context = trace.set_span_in_context(span) if recording else None
        self._ids: list[int] = []
        self._final = 0
        self._runs: dict[tuple[int, int], list[Run]] = {}  # this step's (lo, hi) -> runs
        self._done_layers: set[int] = set()
        self._layer_start = 0  # ns: when this step's current layer began computing
        self._cuda = endpoint.device.type == "cuda"

    # ---- LayerKVSink: called on the engine thread ------------------------------------

    def begin_step(self, block_ids: list[int], num_final: int) -> None:
        self._ids, self._final = block_ids, num_final
        self._done_layers = set()
        self._runs = {}
        self._layer_start = time.time_ns()

    def layer_done(self, layer: int) -> None:
        now = time.time_ns()
        self._span("prefill.layer", self._layer_start, now, layer=layer)
        self._layer_start = now
        self._done_layers.add(layer)
        lo, hi = self.sent[layer], min(self._final, len(self.dst))
        if self.closed or hi <= lo:
            return
        segments = self._plan(layer, lo, hi)
        event = None
        if self._cuda:  # the layer's kernels are queued, not done: the write waits for them
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            if self._started:
                self.futures.append(self.endpoint.thread.submit(self._write, layer, hi,
                                                                segments, event))
            else:
                self._held.append((layer, hi, segments, event))
        self.sent[layer] = hi

    def _plan(self, layer: int, lo: int, hi: int) -> Segments:
        """Segments of blocks [lo, hi) in ``layer``; their runs are found once a step."""
        runs = self._runs.get((lo, hi))
        if runs is None:
            runs = self._runs[(lo, hi)] = self.endpoint.runs(self._ids[lo:hi], self.dst[lo:hi])
        return self.endpoint.place(self.target, runs, range(layer, layer + 1))

    def end_step(self) -> None:
        for layer in range(self.num_layers):
            if layer not in self._done_layers:  # e.g. a step replayed from a CUDA graph
                self.layer_done(layer)
        if self._final == len(self.dst):
            self.loop.call_soon_threadsafe(resolve_once, self.queued, None)

    def rewind(self) -> None:
        self.sent = [0] * self.num_layers

    # ---- the transfer's side ------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """Every layer of every block has landed."""
        return all(n == len(self.dst) for n in self.landed)

    def start(self) -> None:
        """The decode worker accepted the transfer: write (what was held first)."""
        with self._lock:
            self._started = True
            for item in self._held:
                self.futures.append(self.endpoint.thread.submit(self._write, *item))
            self._held.clear()

    def close(self) -> None:
        """No more writes: those queued return without writing."""
        with self._lock:
            self.closed = True
            self._held.clear()

    # ---- the writer thread --------------------------------------------------------------

    def _write(self, layer: int, upto: int, segments, event) -> None:
        if self.closed:
            return
        if event is not None:
            event.synchronize()
        start = time.time_ns()
        self.endpoint.write(self.target.rpc_address, *segments)
        nbytes = sum(segments[2])
        self.bytes_moved += nbytes
        self.num_segments += len(segments[2])
        self.landed[layer] = upto
        self._span("kv_transfer.layer_write", start, time.time_ns(), layer=layer,
                   blocks_upto=upto, bytes=nbytes, segments=len(segments[2]))

    def _span(self, name: str, start: int, end: int, **attributes) -> None:
        if self._context is None:
            return
        _tracer.start_span(name, context=self._context, start_time=start,
                           attributes=attributes).end(end_time=end)
