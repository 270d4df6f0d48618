"""The sending half of a pair's KVFrames stream: every payload the prefill
worker sends over the pair's process group is first announced by a frame,
so the decode worker posts its receives in the order of the sends.

A pump on the event loop takes what the senders post (from the engine
thread, layer by layer, or from the loop), has the pair's thread read the
payload out of the cache, writes its frame, then queues the send on the
pair's thread without waiting for it; the pair's thread runs the sends in
that order. NOTE: reads run on that thread too, so the next payload's read
waits for the send before it: one pair's payloads go one at a time (the
layer timeline in docs/benchmarks.md still shows the sends keeping up with
the compute on a CPU). The read comes first so that a frame written is always followed
by its payload (a payload the decode worker no longer wants is received and
dropped there): the two ends never fall out of step. A read that fails
fails its post alone; if the stream or a send fails, the pair is broken,
and what is queued fails with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kv_transfer.torch_pair import PAYLOAD_TAG, PairGroup
from rpc.errors import Unavailable
from rpc.protos import worker_pb2

logger = logging.getLogger("kv_transfer")

# On the pair's thread: the payload to send (the read of the source blocks).
Read = Callable[[], torch.Tensor]
# On the pair's thread, once sent: (bytes, when the send began in ns).
Sent = Callable[[int, int], None]


def payload_frame(request_id: str, attempt: int, layer: int, first_block: int,
                  num_blocks: int) -> worker_pb2.KVFrame:
    """``layer`` -1: every layer in one payload."""
    return worker_pb2.KVFrame(data=worker_pb2.KVPayload(
        request_id=request_id, attempt=attempt, layer=layer, first_block=first_block,
        num_blocks=num_blocks))


def done_frame(request_id: str, attempt: int) -> worker_pb2.KVFrame:
    return worker_pb2.KVFrame(done=worker_pb2.KVPayloadsDone(request_id=request_id,
                                                             attempt=attempt))


class FrameChannel:
    def __init__(self, pair: PairGroup, call, peer: str) -> None:
        """``call``: the KVFrames stream, its open frame written."""
        self.pair = pair
        self.call = call
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pump = self.loop.create_task(self._run())
        self._watch = self.loop.create_task(self._watch_end())

    def post(self, frame: worker_pb2.KVFrame, read: Read | None = None,
             sent: Sent | None = None) -> Future:
        """Announce ``frame`` and send ``read()`` after it (a done frame has
        no payload). Callable from any thread. The future resolves to the
        bytes sent once the send has ended."""
        future: Future = Future()
        self.loop.call_soon_threadsafe(self._enqueue, (frame, read, sent, future))
        return future

    def _enqueue(self, item) -> None:
        if self._pump.done():  # nothing would take it
            item[-1].set_exception(Unavailable(f"the transfer group with {self.peer} closed"))
        else:
            self._queue.put_nowait(item)

    def close(self) -> None:
        self._pump.cancel()
        self._watch.cancel()
        self.call.cancel()

    async def _watch_end(self) -> None:
        """The decode worker answers nothing: the stream ends only when its
        end of the pair does (its process died, or it closed the pair).
        Then the pair is broken at once, so the next transfer opens a new
        one rather than being refused for want of a group."""
        try:
            await self.call.read()
        except Exception:  # noqa: BLE001, S110 - how it ended does not matter
            pass
        if not self.pair.broken:
            logger.warning("KV frames to %s ended: the pair is closed", self.peer)
        self.pair.broken = True
        self._pump.cancel()

    async def _run(self) -> None:
        item = None
        try:
            while True:
                item = await self._queue.get()
                frame, read, sent, future = item
                if self.pair.broken:
                    raise Unavailable(f"the transfer group with {self.peer} is broken")
                data = None
                if read is not None:
                    try:
                        data = await asyncio.wrap_future(self.pair.submit_local(read))
                    except Exception as exc:  # noqa: BLE001 - this post's failure, not the pair's
                        future.set_exception(exc)
                        item = None
                        continue
                await self.call.write(frame)
                if data is None:
                    future.set_result(0)
                else:
                    _chain(self.pair.submit(self._send, data, sent), future)
                item = None
        except BaseException as exc:
            self.pair.broken = True
            if not isinstance(exc, asyncio.CancelledError):
                logger.warning("KV frames to %s failed: %s", self.peer, exc)
            error = Unavailable(f"the transfer group with {self.peer} closed: {exc!r}")
            pending = [item] if item is not None else []
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            for *_, future in pending:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(exc, asyncio.CancelledError):
                self.call.cancel()

    def _send(self, data: torch.Tensor, sent: Sent | None) -> int:
        start = time.time_ns()
        self.pair.send(data, 1, PAYLOAD_TAG)
        nbytes = data.numel() * data.element_size()
        if sent is not None:
            sent(nbytes, start)
        return nbytes


def _chain(source: Future, target: Future) -> None:
    def copy(f: Future) -> None:
        if f.exception() is not None:
            target.set_exception(f.exception())
        else:
            target.set_result(f.result())

    source.add_done_callback(copy)
