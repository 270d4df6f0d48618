"""Many decode requests over one stream: the worker's side of DecodeMany.

The gateway keeps one such stream open to each decode worker. Each request
it starts there runs the worker's own ``decode`` generator, in a task of its
own, exactly as a Decode call would; what the tasks produce goes out in
batches of everything that came since the last write. The engine hands a
step's outputs to the event loop in one callback, so every request's task
runs before the writer does: a batch is one engine step's chunks.

Why: with a call per request, every token of every request was a gRPC message
of its own (a write here, a wake-up and a read in the gateway), and that was
the largest CPU cost on the serving path beside the engine itself, taken from
the two cores the engine computes on. One message per step costs about as
much as one of those did.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate

from rpc.channel import MAX_MESSAGE_BYTES
from rpc.errors import error_status
from rpc.logs import request_id_var
from rpc.protos import worker_pb2
from worker.base import WorkerBase


class _Outbox:
    """Items waiting for the writer; ``ready`` wakes it."""

    def __init__(self) -> None:
        self.items: list[worker_pb2.DecodeItem] = []
        self.ready = asyncio.Event()

    def put(self, item: worker_pb2.DecodeItem) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list[worker_pb2.DecodeItem]:
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items


# A batch goes out in several messages past this size: one message over the
# channel's limit would fail the stream, and with it every request on it.
BATCH_BYTES = MAX_MESSAGE_BYTES // 4


def _batches(items: list[worker_pb2.DecodeItem]) -> list[worker_pb2.DecodeBatch]:
    """``items`` in as few messages as fit under ``BATCH_BYTES`` each."""
    batches, start, size = [], 0, 0
    for i, item in enumerate(items):
        n = item.ByteSize() + 8  # the item's tag and length in the batch
        if size + n > BATCH_BYTES and i > start:
            batches.append(worker_pb2.DecodeBatch(items=items[start:i]))
            start, size = i, 0
        size += n
    if start < len(items):
        batches.append(worker_pb2.DecodeBatch(items=items[start:]))
    return batches


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
        end = worker_pb2.DecodeItem(tag=tag, end=True)
        try:
            async with contextlib.aclosing(worker.decode(control.start)) as chunks:
                async for chunk in chunks:
                    outbox.put(worker_pb2.DecodeItem(tag=tag, chunk=chunk))
        except Exception as exc:
            code, end.message = error_status(exc)
            end.code = code.value[0]
        # NOTE: not on cancellation: the caller cancelled it and waits for nothing.
        outbox.put(end)

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
                    outbox.put(worker_pb2.DecodeItem(
                        tag=control.tag, end=True, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                        message=f"tag {control.tag} is already running on this stream"))
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
            items = await outbox.take()
            for batch in _batches(items):
                metrics.decode_stream_messages.inc()
                metrics.decode_stream_chunks.inc(sum(i.HasField("chunk") for i in batch.items))
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
