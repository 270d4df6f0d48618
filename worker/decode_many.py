"""Many decode requests over one stream: the worker's side of DecodeMany.

The gateway keeps one such stream open to each decode worker. Each request
it starts there runs the worker's own ``decode`` generator, in a task of its
own, exactly as a Decode call would; what the tasks produce goes out in
batches of everything that came since the last write. The engine hands a
step's outputs to the event loop in one callback, so every request's task
runs before the writer does: a batch is one engine step's chunks.

Why: with a call per request, every token of every request was a gRPC message
of its own (a write here, a wake-up and a read in the gateway), CPU taken from
the two cores the engine computes on; ``sendmsg`` alone was 40% of this
loop's busy samples (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

from opentelemetry import context as otel_context
from opentelemetry import propagate

from rpc.channel import MAX_MESSAGE_BYTES
from rpc.errors import error_status
from rpc.logs import request_id_var
from rpc.protos import worker_pb2
from worker.base import WorkerBase


class _Outbox:
    """Items waiting for the writer, and how many of them carry a chunk;
    ``ready`` wakes the writer."""

    def __init__(self) -> None:
        self.items: list[worker_pb2.DecodeItem] = []
        self.chunks = 0
        self.ready = asyncio.Event()

    def put(self, item: worker_pb2.DecodeItem) -> None:
        self.items.append(item)
        self.ready.set()

    def put_chunk(self, tag: int, chunk: worker_pb2.DecodeChunk) -> None:
        self.chunks += 1
        self.put(worker_pb2.DecodeItem(tag=tag, chunk=chunk))

    async def take(self) -> tuple[list[worker_pb2.DecodeItem], int]:
        """Every item so far, and the number of chunks among them."""
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        chunks, self.chunks = self.chunks, 0
        return items, chunks


def _end(tag: int, error: Exception | None = None) -> worker_pb2.DecodeItem:
    """The item that ends request ``tag``: with the status ``error`` stands for."""
    if error is None:
        return worker_pb2.DecodeItem(tag=tag, end=True)
    code, message = error_status(error)
    return worker_pb2.DecodeItem(tag=tag, end=True, code=code.value[0], message=message)


# A batch goes out in several messages past this size: one message over the
# channel's limit would fail the stream, and with it every request on it.
BATCH_BYTES = MAX_MESSAGE_BYTES // 4


def _batches(items: list[worker_pb2.DecodeItem]) -> list[worker_pb2.DecodeBatch]:
    """``items`` as one message, or, past ``BATCH_BYTES``, halved until each
    part fits (or is one item). One size check a step: the split is rare."""
    if not items:
        return []
    batch = worker_pb2.DecodeBatch(items=items)
    if len(items) == 1 or batch.ByteSize() <= BATCH_BYTES:
        return [batch]
    half = len(items) // 2
    return _batches(items[:half]) + _batches(items[half:])


async def decode_many(worker: WorkerBase, controls: AsyncIterator[worker_pb2.DecodeControl],
                      ) -> AsyncIterator[worker_pb2.DecodeBatch]:
    """Serve one DecodeMany stream: start and cancel requests as the caller
    says, yield their chunks in batches. Ends once the worker has drained
    (or the caller has closed its side) and nothing runs; leaving early (the
    caller went away) aborts every request still running."""
    outbox = _Outbox()
    running: dict[int, asyncio.Task] = {}

    async def run(tag: int, control: worker_pb2.DecodeControl) -> None:
        request_id_var.set(control.start.request_id)
        # The task's own context: decode's spans are children of the caller's.
        otel_context.attach(propagate.extract(dict(control.trace_context)))
        try:
            async with contextlib.aclosing(worker.decode(control.start)) as chunks:
                async for chunk in chunks:
                    outbox.put_chunk(tag, chunk)
        except Exception as exc:
            outbox.put(_end(tag, exc))
        else:
            outbox.put(_end(tag))
        # NOTE: nothing on cancellation: the caller cancelled it and waits for nothing.

    def ended(tag: int, task: asyncio.Task) -> None:
        # NOTE: a callback, not the task's own ``finally``: a task cancelled
        # before its first step never runs its body.
        if running.get(tag) is task:
            del running[tag]
        outbox.ready.set()  # the writer checks whether the stream is over

    async def read() -> None:
        try:
            async for control in controls:
                op = control.WhichOneof("op")
                if op == "start" and control.tag in running:
                    outbox.put(_end(control.tag, ValueError(
                        f"tag {control.tag} is already running on this stream")))
                elif op == "start":
                    task = running[control.tag] = asyncio.ensure_future(run(control.tag, control))
                    task.add_done_callback(functools.partial(ended, control.tag))
                elif op == "cancel" and control.tag in running:
                    running[control.tag].cancel()
        finally:
            outbox.ready.set()  # the writer checks whether the stream is over

    async def watch_drain() -> None:
        await worker.drained.wait()
        outbox.ready.set()

    metrics = worker.metrics
    helpers = [asyncio.ensure_future(read()), asyncio.ensure_future(watch_drain())]
    metrics.decode_streams.inc()
    try:
        while True:
            items, chunks = await outbox.take()
            if chunks:
                metrics.decode_stream_chunks.inc(chunks)
            for batch in _batches(items):
                metrics.decode_stream_messages.inc()
                yield batch
            over = worker.drained.is_set() or helpers[0].done()
            if over and not running and not outbox.items:
                return
    finally:
        metrics.decode_streams.dec()
        tasks = [*helpers, *running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
