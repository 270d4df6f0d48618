"""One request's KV handed to a transport layer by layer, while its prompt
still computes (the engine's ``LayerKVSink``). The bookkeeping shared by
the transports that send this way: mooncake's one-sided writes
(kv_transfer/mooncake_layers.py) and torch's payloads over the pair's
process group (kv_transfer/torch_layers.py).

On the engine thread, as layer ``i`` of a step has stored its KV, the blocks
that became final in that layer are handed to the transport, whose own
thread moves them while layer ``i + 1`` computes::

    engine thread    | layer 0 | layer 1 | layer 2 | ...  | layer L-1 |
    transport thread      [s 0]     [s 1]     [s 2]   ...        [s L-1] -> done

Sends are held back until the decode worker has accepted the transfer
(``start``): no byte lands in its blocks before the reservation is marked
as being written. NOTE: held here, not queued on the transport's thread to
wait there: a queued send that waits would hold up every other request's
sends (and a first contact's preflight) behind a slow decode worker. Each
layer counts the leading blocks that left (``landed``), the completion
count sent with "done". After a preemption the prompt is computed again
into other blocks and every layer is sent again; the sends of one
transport run in order, so the last copy of a block is the good one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import torch
from opentelemetry import trace

from kv_transfer.progress import resolve_once
from rpc.tracing import tracer

_tracer = tracer("tandem.kv_transfer")


class LayerSink(ABC):
    def __init__(self, num_blocks: int, num_layers: int, device: torch.device,
                 span=None) -> None:
        """``num_blocks``: the prompt's (the reservation's). ``span``: the
        transfer's span, parent of one span per layer send. Create the sink
        on the event loop: ``queued`` resolves there once the step that
        completes the prompt has handed over its last layer (before that
        step's sampling)."""
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.sent = [0] * num_layers  # per layer, leading blocks handed over
        self.landed = [0] * num_layers  # per layer, leading blocks moved
        self.bytes_moved = 0
        self.futures: list[Future] = []  # the sends handed to the transport
        self.loop = asyncio.get_running_loop()
        self.queued: asyncio.Future = self.loop.create_future()
        self._held: list[tuple] = []  # sends planned before ``start``
        self._lock = threading.Lock()  # the engine thread plans, the event loop starts
        self._started = False
        self.closed = False  # no more sends (the transfer failed or was cancelled)
        recording = span is not None and span.is_recording()
        self._context = trace.set_span_in_context(span) if recording else None
        self._ids: list[int] = []  # this step's block table of the request
        self._final = 0
        self._done_layers: set[int] = set()
        self._layer_start = 0  # ns: when this step's current layer began computing
        self._cuda = device.type == "cuda"

    # ---- what a transport implements -------------------------------------------------

    @abstractmethod
    def _plan(self, layer: int, lo: int, hi: int):
        """On the engine thread: what ``_submit`` needs to send blocks
        [lo, hi) of ``layer`` (their source block ids are ``self._ids[lo:hi]``)."""

    @abstractmethod
    def _submit(self, layer: int, lo: int, hi: int, plan, event) -> Future:
        """Queue the send on the transport's thread (waiting for the CUDA
        ``event`` first, if any); it sets ``landed[layer] = hi`` when done."""

    def _prepare_step(self) -> None:  # noqa: B027 - optional hook
        """A new step's block table is in ``self._ids``."""

    # ---- LayerKVSink: called on the engine thread ------------------------------------

    def begin_step(self, block_ids: list[int], num_final: int) -> None:
        self._ids, self._final = block_ids, num_final
        self._done_layers = set()
        self._layer_start = time.time_ns()
        self._prepare_step()

    def layer_done(self, layer: int) -> None:
        now = time.time_ns()
        self._span("prefill.layer", self._layer_start, now, layer=layer)
        self._layer_start = now
        self._done_layers.add(layer)
        lo, hi = self.sent[layer], min(self._final, self.num_blocks)
        if self.closed or hi <= lo:
            return
        plan = self._plan(layer, lo, hi)
        event = None
        if self._cuda:  # the layer's kernels are queued, not done: the send waits for them
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            if self.closed:  # NOTE: again under the lock: ``close`` may have run meanwhile
                return
            if self._started:
                self.futures.append(self._submit(layer, lo, hi, plan, event))
            else:
                self._held.append((layer, lo, hi, plan, event))
        self.sent[layer] = hi

    def end_step(self) -> None:
        for layer in range(self.num_layers):
            if layer not in self._done_layers:  # e.g. a step replayed from a CUDA graph
                self.layer_done(layer)
        if self._final == self.num_blocks:
            self.loop.call_soon_threadsafe(resolve_once, self.queued, None)

    def rewind(self) -> None:
        self.sent = [0] * self.num_layers

    # ---- the transfer's side ------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """Every layer of every block has left."""
        return all(n == self.num_blocks for n in self.landed)

    def start(self) -> None:
        """The decode worker accepted the transfer: send (what was held first)."""
        with self._lock:
            self._started = True
            for item in self._held:
                self.futures.append(self._submit(*item))
            self._held.clear()

    def close(self) -> None:
        """No more sends."""
        with self._lock:
            self.closed = True
            self._held.clear()

    async def wait_sent(self) -> None:
        """Until every send handed over so far has ended (raises its error)."""
        for future in list(self.futures):
            await asyncio.wrap_future(future)

    async def settle(self) -> None:
        """Until every send handed over has ended, failed or not (the
        source blocks may go then)."""
        await settle(self.futures)

    async def sent_all(self, request_id: str,
                       after_queued: Callable[[], None] = lambda: None) -> float:
        """Start sending; once the forward pass has handed over its last
        layer, call ``after_queued`` and wait for every send to end. The
        time the last was handed over; RuntimeError if a layer missed
        blocks."""
        self.start()
        await self.queued
        after_queued()
        started = time.perf_counter()
        await self.wait_sent()
        if not self.complete:
            raise RuntimeError(f"layer sends of {request_id!r} missed blocks: sent "
                               f"{self.landed}, {self.num_blocks} each")
        return started

    def _span(self, name: str, start: int, end: int, **attributes) -> None:
        if self._context is None:
            return
        _tracer.start_span(name, context=self._context, start_time=start,
                           attributes=attributes).end(end_time=end)


async def settle(futures: Iterable[Future]) -> None:
    """Until every one of ``futures`` has ended, failed or not. Their errors
    are the caller's to have seen already: read here, so that asyncio does
    not log each as never retrieved."""
    futures = [asyncio.wrap_future(f) for f in futures]
    if futures:
        await asyncio.wait(futures)
    for future in futures:
        if not future.cancelled():
            future.exception()
