"""A client-streaming call refused on an early message keeps its status.

Without ``rpc.refusal`` about half of these calls ended INTERNAL ("Internal
error from Core", grpc issue 36066): the caller's next write met the finished
call and its failure replaced the handler's NOT_FOUND. It reached the
gateway as a decode worker's internal error instead of an expired
reservation (test_workers.py::test_unused_reservation_expires flaked so).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from rpc.errors import NotFound
from rpc.protos import worker_pb2, worker_pb2_grpc
from rpc.refusal import send_stream
from rpc.server import GrpcServer


class Refusing(worker_pb2_grpc.WorkerServicer):
    """Refuses every PushKV on its first chunk, as a decode worker refuses KV
    for a reservation it no longer holds."""

    async def PushKV(self, request_iterator, context):
        async for _ in request_iterator:
            raise NotFound("no reservation for request 'r'")
        return worker_pb2.PushKVResponse()


@pytest.fixture
async def stub():
    server = GrpcServer("127.0.0.1", 0)
    worker_pb2_grpc.add_WorkerServicer_to_server(Refusing(), server.server)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield worker_pb2_grpc.WorkerStub(channel)
    await channel.close()
    await server.stop(0)


def chunks(n: int, sent: list[int]):
    async def gen():
        for i in range(n):
            sent.append(i)
            yield worker_pb2.KVChunk(request_id="r", data=b"\0" * 100)
            await asyncio.sleep(0)  # as a sender between layers
    return gen()


async def test_the_refusal_is_the_status_and_the_sender_stops(stub):
    sent: list[int] = []
    for _ in range(100):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await send_stream(stub.PushKV, chunks(200, sent))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
        assert "no reservation" in err.value.details()
    # Each call stopped after a few chunks instead of sending all 200.
    assert len(sent) < 100 * 20


async def test_a_plain_client_stream_gets_the_status_too(stub):
    """A caller that ignores the refusal: the server reads on until it has
    sent everything, so no write meets a finished call either."""
    sent: list[int] = []
    for _ in range(100):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PushKV(chunks(200, sent))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
    assert len(sent) == 100 * 200


async def test_a_sender_waiting_for_its_next_chunk_stops_at_once(stub):
    closed = []

    async def slow():
        try:
            yield worker_pb2.KVChunk(request_id="r")
            await asyncio.sleep(60)  # a long prefill chunk being computed
            yield worker_pb2.KVChunk(request_id="r")
        finally:
            closed.append(True)

    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await send_stream(stub.PushKV, slow())
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert time.monotonic() - start < 30
    assert closed == [True]


async def test_a_failing_sender_still_fails_the_call(stub):
    async def broken():
        yield worker_pb2.KVChunk(request_id="r")
        raise RuntimeError("the KV could not be read")

    # Either the refusal or grpc's cancel of a broken iterator; never a hang.
    with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):
        await asyncio.wait_for(send_stream(stub.PushKV, broken()), 30)
