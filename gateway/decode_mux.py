"""Many decode requests over one stream: the gateway's side of DecodeMany.

One ``DecodeMux`` per decode worker holds one DecodeMany call open; every
request the gateway decodes there is started on it under a tag and read back
through a ``MuxedDecode``, which behaves as the Decode call it replaces:
iterate it for the request's chunks, the iteration raises the request's
error status as an ``AioRpcError`` (or the call's own, should the stream
break), and ``cancel`` stops the request on the worker and ends the
iteration with ``CancelledError``.

The worker writes one message per engine step for all its requests, not
one per request (worker/decode_many.py says why).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging

import grpc
from opentelemetry import propagate

from rpc.protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger("gateway")

_STATUS = {code.value[0]: code for code in grpc.StatusCode}
_END = object()  # the request ended well
_CANCELLED = object()  # the consumer's own cancel


def _rpc_error(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)


class MuxedDecode:
    """One request on a ``DecodeMux``, read as a Decode call is."""

    def __init__(self, mux: DecodeMux, tag: int) -> None:
        self._mux = mux
        self._tag = tag
        self._queue: asyncio.Queue = asyncio.Queue()
        self._last = None  # how the iteration ended: it ends that way again

    def _deliver(self, item: worker_pb2.DecodeItem) -> None:
        if item.HasField("chunk"):
            self._queue.put_nowait(item.chunk)
        if item.end:
            code = _STATUS.get(item.code, grpc.StatusCode.UNKNOWN)
            self._queue.put_nowait(_END if code == grpc.StatusCode.OK
                                   else _rpc_error(code, item.message))

    def _fail(self, error: grpc.aio.AioRpcError) -> None:
        self._queue.put_nowait(error)

    def __aiter__(self) -> MuxedDecode:
        return self

    async def __anext__(self) -> worker_pb2.DecodeChunk:
        item = self._last if self._last is not None else await self._queue.get()
        if isinstance(item, worker_pb2.DecodeChunk):
            return item
        self._last = item
        if item is _END:
            raise StopAsyncIteration
        if item is _CANCELLED:
            raise asyncio.CancelledError()
        raise item

    def cancel(self) -> None:
        """Stop the request on the worker; the iteration ends with
        ``CancelledError`` (as a cancelled call's does)."""
        if self._mux._cancel(self._tag):
            self._queue.put_nowait(_CANCELLED)

    def close(self) -> None:
        """Done reading: a request still running on the worker is stopped."""
        self._mux._cancel(self._tag)


def open_mux(stub: worker_pb2_grpc.WorkerStub, address: str) -> DecodeMux:
    """A ``DecodeMux`` created outside the current request's context: its
    tasks copy no request id or span of the request that opened it."""
    return contextvars.Context().run(DecodeMux, stub, address)


class DecodeMux:
    """One DecodeMany call to one worker, shared by the requests decoded
    there. Once the call has ended (``closed``), the pool opens another."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, address: str) -> None:
        """Opens the call. Create it in an empty context (``open_mux``): the
        call and its reader outlive the request that happened to open them."""
        self.address = address
        self.closed = False
        self._tags = itertools.count(1)
        self._requests: dict[int, MuxedDecode] = {}
        self._controls: asyncio.Queue = asyncio.Queue()
        self._call = stub.DecodeMany(self._send())
        self._reader = asyncio.ensure_future(self._read())

    def start(self, request: worker_pb2.DecodeRequest) -> MuxedDecode:
        """Start ``request`` on the worker, under the current trace context."""
        if self.closed:
            raise RuntimeError(f"the decode stream to {self.address} has ended")
        tag = next(self._tags)
        control = worker_pb2.DecodeControl(tag=tag, start=request)
        propagate.inject(control.trace_context)
        decode = self._requests[tag] = MuxedDecode(self, tag)
        self._controls.put_nowait(control)
        return decode

    def _cancel(self, tag: int) -> bool:
        """Stop request ``tag`` if it still runs (True); a cancel goes to the
        worker unless the stream has ended."""
        if self._requests.pop(tag, None) is None:
            return False  # it ended, failed or was cancelled already
        if not self.closed:
            self._controls.put_nowait(worker_pb2.DecodeControl(tag=tag, cancel=True))
        return True

    async def _send(self):
        while (control := await self._controls.get()) is not None:
            yield control

    async def _read(self) -> None:
        error = _rpc_error(grpc.StatusCode.UNAVAILABLE,
                           f"worker {self.address} ended its decode stream")
        try:
            async for batch in self._call:
                for item in batch.items:
                    decode = self._requests.get(item.tag)
                    if decode is None:
                        continue  # cancelled here; the worker had not seen it yet
                    if item.end:
                        del self._requests[item.tag]
                    decode._deliver(item)
        except grpc.aio.AioRpcError as err:
            # NOTE: UNAVAILABLE for each request whatever the call's status
            # (UNIMPLEMENTED from a worker that predates DecodeMany, say):
            # it says nothing about the request, which may go elsewhere.
            error = _rpc_error(grpc.StatusCode.UNAVAILABLE,
                               f"decode stream to {self.address}: {err.code().name}: "
                               f"{err.details()}")
        except asyncio.CancelledError:
            # Closed here: the worker left rotation, or the gateway is stopping.
            error = _rpc_error(grpc.StatusCode.UNAVAILABLE,
                               f"the decode stream to {self.address} was closed")
            raise
        finally:
            self.closed = True
            self._call.cancel()  # a no-op once it has ended; else its requests stop
            self._controls.put_nowait(None)
            requests, self._requests = list(self._requests.values()), {}
            if requests:
                logger.warning("decode stream to %s ended with %s: failing %d requests",
                               self.address, error.code().name, len(requests))
            for decode in requests:
                decode._fail(error)

    async def close(self) -> None:
        """End the call; requests still on it fail with UNAVAILABLE (so the
        orchestrator moves them)."""
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
