"""DecodeMany: many requests over one stream, between real processes.

A colocated ("both") worker runs as its own process; the test drives it
through the gateway's ``DecodeMux`` over real gRPC, and checks that the
stream carries every request as its own Decode call would (same tokens, its
own errors, cancelling one stops only that one), that a step's chunks go out
together, and that nothing is left behind on the worker when requests or
the whole stream end early.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from engine_fixtures import random_prompts, tiny
from worker_fixtures import Gateway, Worker, params, start_worker

from gateway.decode_mux import DecodeMux, MuxedDecode
from rpc.protos import worker_pb2
from tandem.cluster import LocalCluster
from worker.decode_many import BATCH_BYTES, _batches

NUM_BLOCKS = 96
StatusCode = grpc.StatusCode


@pytest.fixture(scope="module")
def model_dir():
    return tiny("llama-gqa")[0]


@pytest.fixture(scope="module")
def both(model_dir):
    with LocalCluster() as cluster:
        yield start_worker(cluster, "both", model_dir, NUM_BLOCKS)


@pytest.fixture
async def gw():
    async with Gateway() as g:
        yield g


def start(mux: DecodeMux, request_id: str, prompt: list[int], **sp) -> MuxedDecode:
    return mux.start(worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, params=params(**sp)))


async def collect(decode: MuxedDecode) -> tuple[list[int], str]:
    tokens, reason = [], ""
    async for chunk in decode:
        tokens += chunk.token_ids
        reason = chunk.finish_reason or reason
    return tokens, reason


async def test_requests_on_one_stream_match_their_own_calls(both, gw):
    prompts = random_prompts([5, 30, 17, 64, 9, 41], seed=11)
    lengths = [12, 3, 20, 8, 1, 16]
    alone = [await gw.colocated(both, f"one-{i}", p, params(temperature=0, max_tokens=m))
             for i, (p, m) in enumerate(zip(prompts, lengths))]
    mux = DecodeMux(gw.stub(both), both.address)
    try:
        together = await asyncio.gather(*(
            collect(start(mux, f"many-{i}", p, temperature=0, max_tokens=m))
            for i, (p, m) in enumerate(zip(prompts, lengths))))
    finally:
        await mux.close()
    for (tokens, reason), single, m in zip(together, alone, lengths):
        assert tokens == single.token_ids and len(tokens) == m
        assert reason == single.finish_reason == "length"
    await gw.wait_idle([both])


async def test_a_step_of_several_requests_is_one_message(both, gw):
    """Read raw: the batches of a stream with four requests decoding at once."""
    prompts = random_prompts([8] * 4, seed=12)
    # Long enough that the four overlap however late the worker reads a start.
    sp = params(temperature=0, max_tokens=200, ignore_eos=True)
    controls: asyncio.Queue = asyncio.Queue()

    async def send():
        while (c := await controls.get()) is not None:
            yield c

    for tag, p in enumerate(prompts, 1):
        controls.put_nowait(worker_pb2.DecodeControl(tag=tag, start=worker_pb2.DecodeRequest(
            request_id=f"batch-{tag}", prompt_token_ids=p, params=sp)))
    call = gw.stub(both).DecodeMany(send(), timeout=60)
    tokens: dict[int, int] = {}
    widest, ended = 0, set()
    async for batch in call:
        widest = max(widest, len({i.tag for i in batch.items if i.chunk.token_ids}))
        for item in batch.items:
            tokens[item.tag] = tokens.get(item.tag, 0) + len(item.chunk.token_ids)
            if item.end:
                assert item.code == 0, item.message
                ended.add(item.tag)
        if len(ended) == 4:
            controls.put_nowait(None)  # our side is done: the worker ends the call
    assert tokens == {1: 200, 2: 200, 3: 200, 4: 200}
    # Decoding together, the four requests' tokens of a step share messages.
    assert widest >= 2
    await gw.wait_idle([both])


async def test_errors_and_cancels_stay_with_their_request(both, gw):
    mux = DecodeMux(gw.stub(both), both.address)
    try:
        long = start(mux, "keep", [3, 4, 5], temperature=0, max_tokens=60, ignore_eos=True)
        sp = params(temperature=0, max_tokens=4)
        sp.top_p = 0.0  # past the client-side check: the worker must refuse it
        bad = mux.start(worker_pb2.DecodeRequest(request_id="bad", prompt_token_ids=[3, 4, 5],
                                                 params=sp))
        empty = start(mux, "empty", [], temperature=0, max_tokens=4)
        missing = mux.start(worker_pb2.DecodeRequest(request_id="never-reserved",
                                                     first_token_id=7, params=params()))
        for decode, code, words in [(bad, StatusCode.INVALID_ARGUMENT, "top_p"),
                                    (empty, StatusCode.INVALID_ARGUMENT, "empty"),
                                    (missing, StatusCode.NOT_FOUND, "never-reserved")]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(decode)
            assert err.value.code() == code and words in err.value.details()
        # One request cancelled mid-stream: the iteration ends, its blocks are freed.
        doomed = start(mux, "doomed", [9, 8, 7], temperature=0, max_tokens=500, ignore_eos=True)
        got = 0
        with pytest.raises(asyncio.CancelledError):  # as a cancelled call's iteration
            async for chunk in doomed:
                got += len(chunk.token_ids)
                if got >= 2:
                    doomed.cancel()
        assert 2 <= got < 500
        # The same request id again, on the same stream, once the cancel is through.
        again = start(mux, "doomed", [9, 8, 7], temperature=0, max_tokens=5)
        assert await collect(again) == (await collect(
            start(mux, "doomed-2", [9, 8, 7], temperature=0, max_tokens=5)))
        # The request that shared the stream with all of that finished in full.
        assert await collect(long) == (await collect(
            start(mux, "keep-2", [3, 4, 5], temperature=0, max_tokens=60, ignore_eos=True)))
        assert not mux.closed
    finally:
        await mux.close()
    await gw.wait_idle([both])


async def test_a_duplicate_tag_is_refused_alone(both, gw):
    # Long enough that the first request is surely still running when the
    # second start reaches the worker (it is sent once the first chunk is back).
    sp = params(temperature=0, max_tokens=300, ignore_eos=True)
    controls = [worker_pb2.DecodeControl(tag=7, start=worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3], params=sp)) for rid in ("dup-a", "dup-b")]
    first_chunk = asyncio.Event()

    async def send():
        yield controls[0]
        await first_chunk.wait()
        yield controls[1]
        await asyncio.sleep(30)  # keep our side open until the worker has answered

    call = gw.stub(both).DecodeMany(send(), timeout=60)
    ends, tokens = [], 0
    async for batch in call:
        first_chunk.set()
        for item in batch.items:
            tokens += len(item.chunk.token_ids)
            if item.end:
                ends.append((item.code, item.message, tokens))
        if len(ends) == 2:
            call.cancel()
            break
    code, message, tokens_then = ends[0]
    assert (code, message) == (StatusCode.INVALID_ARGUMENT.value[0],
                               "tag 7 is already running on this stream")
    assert tokens_then < 300  # refused while the first request was running
    assert ends[1] == (0, "", 300)  # the first request under the tag ran to its end
    await gw.wait_idle([both])


@pytest.mark.parametrize("how", ["close", "drop"])
async def test_a_stream_that_ends_aborts_its_requests(both, gw, how):
    """Whether the gateway closes its stream or simply goes away, every
    request still running on it stops, and its blocks come back."""
    mux = DecodeMux(gw.stub(both), both.address)
    running = [start(mux, f"gone-{how}-{i}", [i + 1, 2, 3], temperature=0, max_tokens=800,
                     ignore_eos=True) for i in range(3)]
    for decode in running:
        await decode.__anext__()
    if how == "close":
        await mux.close()
        for decode in running:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(decode)
            assert err.value.code() == StatusCode.UNAVAILABLE
    else:
        await gw.channels.close()  # the connection goes, as with a dead gateway
    await gw.wait_idle([both])


async def test_drain_finishes_the_stream_then_ends_it(model_dir):
    with LocalCluster() as cluster:
        w: Worker = start_worker(cluster, "both", model_dir, NUM_BLOCKS, "--grace", "60")
        async with Gateway() as gw:
            mux = DecodeMux(gw.stub(w), w.address)
            # Started again at once after a cancel: the old call, still
            # winding down, must not take the new one out of the drain's count.
            gone = start(mux, "drain", [5, 6, 7], temperature=0, max_tokens=900, ignore_eos=True)
            await gone.__anext__()
            gone.cancel()
            # Long enough to outlast the server's 1 s stop after an empty drain.
            long = start(mux, "drain", [5, 6, 7], temperature=0, max_tokens=1000, ignore_eos=True)
            first = await long.__anext__()
            w.proc.popen.send_signal(signal.SIGTERM)
            refused = None
            for _ in range(200):  # new requests are refused once it drains
                late = start(mux, "late", [5, 6], temperature=0, max_tokens=3)
                try:
                    await collect(late)
                except grpc.aio.AioRpcError as err:
                    refused = err
                    break
                await asyncio.sleep(0.02)
            assert refused is not None and refused.code() == StatusCode.UNAVAILABLE
            assert "draining" in refused.details()
            tokens, reason = await collect(long)
            assert len(first.token_ids) + len(tokens) == 1000 and reason == "length"
            # Then the worker ends the stream and exits.
            assert await asyncio.to_thread(w.proc.popen.wait, 15) == 0
            assert mux.closed



def test_a_large_batch_goes_out_in_several_messages():
    chunk = worker_pb2.DecodeChunk(text="x" * (BATCH_BYTES // 3))
    items = [worker_pb2.DecodeItem(tag=t, chunk=chunk) for t in range(1, 8)]
    batches = _batches(items)
    assert len(batches) == 4  # two items fit under the limit, a third does not
    assert all(b.ByteSize() <= BATCH_BYTES for b in batches)
    assert [i.tag for b in batches for i in b.items] == list(range(1, 8))
    assert len(_batches(items[:1])) == 1 and _batches([]) == []


async def test_a_stream_the_peer_refuses_fails_each_request_as_unavailable():
    """A worker without DecodeMany (an older one) answers the call with
    UNIMPLEMENTED: that says nothing about the requests, which may go to
    another worker, so each one fails with UNAVAILABLE."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with Gateway() as gw:
            address = f"127.0.0.1:{port}"
            mux = DecodeMux(gw.stub(address), address)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(start(mux, "nowhere", [1, 2], temperature=0, max_tokens=3))
            assert err.value.code() == StatusCode.UNAVAILABLE
            assert "UNIMPLEMENTED" in err.value.details()
            assert mux.closed
    finally:
        await server.stop(None)
