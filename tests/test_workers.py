"""Prefill, decode and colocated workers as real processes on loopback.

The test plays the gateway (Reserve -> Prefill -> Decode over gRPC) against
one prefill worker, two decode workers and one colocated ("both") worker on
a tiny model, with small KV caches so that a leaked block shows up in Info.
"""

from __future__ import annotations

import asyncio
import datetime
import random
import signal
import time
import uuid
from dataclasses import dataclass

import grpc
import pytest
import torch
import torch.distributed as dist
from engine_fixtures import random_prompts, tiny
from worker_fixtures import (
    Gateway,
    Worker,
    metric,
    params,
    rpc_error,
    scrape,
    start_worker,
    start_worker_set,
)

from engine.sampling_params import SamplingParams
from kv_transfer.torch_frames import done_frame, payload_frame
from kv_transfer.torch_pair import PAYLOAD_TAG, make_group
from rpc.convert import stop_reason_from_proto
from rpc.protos import worker_pb2
from tandem.cluster import LocalCluster

NUM_BLOCKS = 96  # 1536 tokens of KV per worker
TRANSPORTS = ["grpc", "torch"]
StatusCode = grpc.StatusCode


@dataclass
class Workers:
    prefill: Worker
    decodes: list[Worker]
    both: Worker

    @property
    def all(self) -> list[Worker]:
        return [self.prefill, *self.decodes, self.both]


@pytest.fixture(scope="module")
def model_dir():
    return tiny("llama-gqa")[0]


@pytest.fixture(scope="module")
def workers(model_dir):
    with LocalCluster() as cluster:
        # Chunked prefill of 8 tokens a step: a long prompt takes a hundred
        # steps, so an abort can land while it computes.
        prefill, *decodes, both = start_worker_set(cluster, [
            ("prefill", ("--max-num-batched-tokens", "8")),
            ("decode", ()), ("decode", ()), ("both", ())], model_dir, NUM_BLOCKS, metrics=True)
        yield Workers(prefill, decodes, both)


@pytest.fixture(scope="module")
def offline(model_dir):
    from tandem import LLM

    return LLM(str(model_dir), dtype="float32", num_blocks=256)


@pytest.fixture
async def gw():
    async with Gateway() as g:
        yield g


def unique_prompt(length: int) -> list[int]:
    """A prompt no earlier test used, so no prefix-cache hit shortens it."""
    return random_prompts([length], seed=random.randrange(1 << 30))[0]


async def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


# ---- 1. disaggregated == colocated == offline -------------------------------------------------

# Mixed lengths up to 10 blocks; max_tokens=1 ends at the prefill's own token.
PROMPT_LENGTHS = [3, 17, 40, 100, 160, 33]
MAX_TOKENS = [12, 1, 16, 8, 12, 5]


def sampling(kind: str) -> list[SamplingParams]:
    if kind == "greedy":
        return [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    return [SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=m)
            for i, m in enumerate(MAX_TOKENS)]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_disaggregated_matches_colocated_and_offline(workers, offline, gw, transport, kind):
    prompts = random_prompts(PROMPT_LENGTHS, seed=7)
    sps = sampling(kind)
    tag = f"{transport}-{kind}"
    disagg = await asyncio.gather(*(
        gw.disaggregated(workers.prefill, workers.decodes[i % 2], f"d-{tag}-{i}", prompt,
                         params(**vars(sp)), transport)
        for i, (prompt, sp) in enumerate(zip(prompts, sps))
    ))
    colocated = await asyncio.gather(*(
        gw.colocated(workers.both, f"c-{tag}-{i}", prompt, params(**vars(sp)))
        for i, (prompt, sp) in enumerate(zip(prompts, sps))
    ))
    reference = offline.generate(prompts, sps, use_tqdm=False)
    expected = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in reference]
    assert [(c.token_ids, c.finish_reason) for c in colocated] == expected
    assert [(d.token_ids, d.finish_reason) for d in disagg] == expected
    await gw.wait_idle(workers.all)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_finished_prefill_holds_nothing(workers, gw, transport):
    """Once its prefill has answered, the prefill worker no longer counts
    the request as in flight: the same id can run again at once (a retry),
    and a drain would not wait its whole grace for it nor hand it back."""
    prompt, sp = unique_prompt(40), params(temperature=0, max_tokens=4)
    rid = f"again-{transport}"
    first = await gw.disaggregated(workers.prefill, workers.decodes[0], rid, prompt, sp, transport)
    again = await gw.disaggregated(workers.prefill, workers.decodes[1], rid, prompt, sp, transport)
    assert again.token_ids == first.token_ids and len(first.token_ids) == 4
    await gw.wait_idle(workers.all)


async def test_first_token_from_the_prefill_is_not_streamed_again(workers, offline, gw):
    """The gateway's path: the prefill's reply is the completion's first
    chunk (with its finish reason when that token ends the request, then the
    reservation is aborted); Decode with ``first_token_sent`` streams from
    token 2 on."""
    prompts = random_prompts([9, 30, 70, 12], seed=11)
    sps = [SamplingParams(temperature=0, max_tokens=10, logprobs=2),
           SamplingParams(temperature=0.8, seed=5, max_tokens=6),
           SamplingParams(temperature=0, max_tokens=1),
           SamplingParams(temperature=0, max_tokens=8)]
    greedy_first = offline.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=1),
                                    use_tqdm=False)[0].outputs[0].token_ids[0]
    sps[3].stop_token_ids = [greedy_first]
    reference = offline.generate(prompts, sps, use_tqdm=False)
    for i, (prompt, sp, ref) in enumerate(zip(prompts, sps, reference)):
        want = ref.outputs[0]
        rid, p, decode = f"sent-{i}", params(**vars(sp)), workers.decodes[i % 2]
        ticket = await gw.reserve(decode, rid, prompt, p)
        first = await gw.prefill(workers.prefill, rid, prompt, p, ticket)
        assert first.first_token_id == want.token_ids[0]
        assert first.HasField("first_logprobs") == (sp.logprobs is not None)
        if len(want.token_ids) == 1:
            assert (first.finish_reason, stop_reason_from_proto(first)) == (
                want.finish_reason, want.stop_reason)
            assert await gw.abort(decode, rid)  # what the gateway does instead of Decode
            continue
        assert first.finish_reason == ""
        rest = await gw.decode(decode, rid, p, first=first, first_token_sent=True)
        assert [first.first_token_id, *rest.token_ids] == want.token_ids
        assert rest.finish_reason == want.finish_reason
        assert rest.chunks == len(rest.token_ids)  # one a step; none for the skipped token
    assert [len(r.outputs[0].token_ids) for r in reference] == [10, 6, 1, 1]
    await gw.wait_idle(workers.all)


async def test_preflight_measures_each_peer_once(workers, gw):
    prompt = unique_prompt(40)
    sp = params(temperature=0, max_tokens=2)
    for transport in TRANSPORTS:
        for i, decode in enumerate(workers.decodes):
            await gw.disaggregated(workers.prefill, decode, f"pf-{transport}-{i}", prompt, sp,
                                   transport)
    text = scrape(workers.prefill.metrics_port)
    for transport in TRANSPORTS:
        for decode in workers.decodes:
            rate = metric(text, "tandem:kv_transport_bandwidth_bytes_per_second",
                          transport=transport, peer=decode.worker_id)
            assert rate is not None and rate > 1 << 20, (transport, decode.worker_id, rate)
        sent = metric(text, "tandem:kv_transfer_bytes_total", transport=transport,
                      direction="send")
        assert sent and sent > 0
    log = workers.prefill.proc.output()
    for decode in workers.decodes:
        assert log.count(f"preflight grpc -> {decode.worker_id}:") == 1
        assert log.count(f"preflight torch -> {decode.worker_id}:") == 1
    await gw.wait_idle(workers.all)


# ---- 2. aborts, leases, unknown requests ---------------------------------------------------------


@pytest.mark.parametrize("how", ["cancel", "abort"])
async def test_abort_during_prefill_frees_everything(workers, gw, how):
    decode = workers.decodes[0]
    sp = params(temperature=0, max_tokens=4)
    for attempt in range(5):
        rid, prompt = f"ap-{how}-{attempt}", unique_prompt(1000)  # 125 steps
        ticket = await gw.reserve(decode, rid, prompt, sp)
        call = asyncio.ensure_future(gw.prefill(workers.prefill, rid, prompt, sp, ticket))
        if await _caught_computing(gw, workers.prefill, call):
            break
        await gw.abort(decode, rid)  # too late: finished before we looked; again
    else:
        pytest.fail("never caught the prefill computing")
    if how == "cancel":
        call.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await call
    else:
        assert await gw.abort(workers.prefill, rid)
        err = await rpc_error(call)
        assert err.code() == StatusCode.ABORTED, err.details()
        assert "aborted during prefill" in err.details()
    assert await gw.abort(decode, rid)  # the gateway releases the reservation
    await gw.wait_idle(workers.all)


async def _caught_computing(gw: Gateway, prefill: Worker, call: asyncio.Future) -> bool:
    while not call.done():
        if (await gw.info(prefill)).num_running > 0:
            return True
    await asyncio.gather(call, return_exceptions=True)
    return False


async def test_abort_during_grpc_transfer_frees_reservation(workers, gw):
    """The test is the sender: half the KV, an Abort, then the rest."""
    decode, rid = workers.decodes[1], "at-grpc"
    prompt = unique_prompt(100)
    sp = params(temperature=0, max_tokens=4)
    ticket = await gw.reserve(decode, rid, prompt, sp)
    layout = ticket.layout
    per_block = 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * 4
    n = len(ticket.block_ids)
    chunks: asyncio.Queue = asyncio.Queue()

    async def stream():
        while (chunk := await chunks.get()) is not None:
            yield chunk

    def chunk(layer: int, first: bool) -> worker_pb2.KVChunk:
        return worker_pb2.KVChunk(request_id=rid, layout=layout if first else None, layer=layer,
                                  first_block=0, num_blocks=n, data=bytes(n * per_block))

    push = asyncio.ensure_future(gw.stub(decode).PushKV(stream(), timeout=30))
    chunks.put_nowait(chunk(0, True))
    await asyncio.sleep(0.3)  # the first layer lands
    assert await gw.abort(decode, rid)
    for layer in range(1, layout.num_layers):
        chunks.put_nowait(chunk(layer, False))
    chunks.put_nowait(None)
    err = await rpc_error(push)
    assert err.code() == StatusCode.NOT_FOUND, err.details()
    await gw.wait_idle(workers.all)


class TorchPeer:
    """The test process as the prefill end of a torch transfer group: the
    group, its KVFrames stream, and WriteKV control streams."""

    def __init__(self, gw: Gateway, decode: Worker) -> None:
        self.gw, self.decode = gw, decode
        self.worker_id = f"test-{uuid.uuid4().hex[:6]}"
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=30))

    async def open(self) -> None:
        name = f"kv/{self.worker_id}"
        loop = asyncio.get_running_loop()
        building = loop.run_in_executor(None, make_group, dist.PrefixStore(name, self.store), 0,
                                        torch.device("cpu"))
        await self.gw.stub(self.decode).OpenTransferGroup(worker_pb2.OpenTransferGroupRequest(
            prefill_worker_id=self.worker_id, store_address=f"127.0.0.1:{self.store.port}",
            group_name=name,
        ), timeout=30)
        self.group = await building
        self.frames = self.gw.stub(self.decode).KVFrames()
        await self.frames.write(worker_pb2.KVFrame(open=worker_pb2.KVFramesOpen(
            prefill_worker_id=self.worker_id, group_name=name)))

    async def begin(self, ticket: worker_pb2.Ticket):
        """A WriteKV stream, begun (its first answer is "ready" or an error)."""
        call = self.gw.stub(self.decode).WriteKV(timeout=30)
        await call.write(worker_pb2.WriteKVMessage(begin=worker_pb2.WriteKVBegin(
            request_id=ticket.request_id, prefill_worker_id=self.worker_id,
            layout=ticket.layout, num_blocks=len(ticket.block_ids), attempt=ticket.attempt,
            transport="torch")))
        return call

    async def payload(self, ticket: worker_pb2.Ticket, layer: int, first: int, n: int) -> None:
        """Announce and send ``n`` blocks of ``layer`` (-1: all) of KV (ones)."""
        lay = ticket.layout
        layers = (lay.num_layers,) if layer < 0 else ()
        data = torch.ones(*layers, 2, n, lay.block_size, lay.num_kv_heads, lay.head_dim)
        await self.frames.write(payload_frame(ticket.request_id, ticket.attempt, layer, first,
                                              n))
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.group.send([data], 1, PAYLOAD_TAG).wait())

    async def finish(self, ticket: worker_pb2.Ticket, call) -> worker_pb2.WriteKVReply:
        await self.frames.write(done_frame(ticket.request_id, ticket.attempt))
        await call.write(worker_pb2.WriteKVMessage(done=worker_pb2.WriteKVDone(
            num_blocks=len(ticket.block_ids))))
        await call.done_writing()
        return await call.read()


async def test_abort_during_torch_transfer_keeps_the_pair_usable(workers, gw):
    decode = workers.decodes[1]
    sp = params(temperature=0, max_tokens=4)
    peer = TorchPeer(gw, decode)
    await peer.open()

    # Aborted before the transfer begins: refused, and nothing is sent.
    ticket = await gw.reserve(decode, "tt-early", unique_prompt(100), sp)
    num_layers = ticket.layout.num_layers
    assert await gw.abort(decode, "tt-early")
    call = await peer.begin(ticket)
    err = await rpc_error(call.read())
    assert err.code() == StatusCode.NOT_FOUND and "no reservation" in err.details()

    # Aborted while the payloads arrive: the rest are received and dropped.
    ticket = await gw.reserve(decode, "tt-mid", unique_prompt(100), sp)
    call = await peer.begin(ticket)
    assert (await call.read()).ready
    await peer.payload(ticket, 0, 0, len(ticket.block_ids))
    assert await gw.abort(decode, "tt-mid")
    for layer in range(1, num_layers):
        await peer.payload(ticket, layer, 0, len(ticket.block_ids))
    err = await rpc_error(peer.finish(ticket, call))
    assert err.code() == StatusCode.NOT_FOUND, err.details()
    await gw.wait_idle(workers.all)

    # A layer missing: refused at done, with what landed.
    ticket = await gw.reserve(decode, "tt-short", unique_prompt(100), sp)
    n = len(ticket.block_ids)
    call = await peer.begin(ticket)
    assert (await call.read()).ready
    for layer in range(num_layers - 1):
        await peer.payload(ticket, layer, 0, n)
    err = await rpc_error(peer.finish(ticket, call))
    assert err.code() == StatusCode.INVALID_ARGUMENT
    assert f"written by layer: {[n] * (num_layers - 1) + [0]}" in err.details()
    assert await gw.abort(decode, "tt-short")

    # Blocks outside the reservation: refused at done.
    ticket = await gw.reserve(decode, "tt-out", unique_prompt(100), sp)
    call = await peer.begin(ticket)
    assert (await call.read()).ready
    await peer.payload(ticket, -1, 1, len(ticket.block_ids))
    err = await rpc_error(peer.finish(ticket, call))
    assert err.code() == StatusCode.INVALID_ARGUMENT and "outside the" in err.details()
    assert await gw.abort(decode, "tt-out")
    await gw.wait_idle(workers.all)

    # The pair still works: all layers at once, then layer by layer in two halves.
    for rid in ("tt-ok", "tt-layers"):
        ticket = await gw.reserve(decode, rid, unique_prompt(100), sp)
        n = len(ticket.block_ids)
        call = await peer.begin(ticket)
        assert (await call.read()).ready
        if rid == "tt-ok":
            await peer.payload(ticket, -1, 0, n)
        else:
            for layer in range(num_layers):
                await peer.payload(ticket, layer, 0, n // 2)
            for layer in range(num_layers):
                await peer.payload(ticket, layer, n // 2, n - n // 2)
        reply = await peer.finish(ticket, call)
        lay = ticket.layout
        assert reply.bytes_received == (num_layers * 2 * n * lay.block_size * lay.num_kv_heads
                                        * lay.head_dim * 4)
        assert await gw.abort(decode, rid)
    await gw.wait_idle(workers.all)


async def test_a_torch_send_whose_read_fails_fails_alone(workers, gw):
    """The real TorchSender in this process, to a decode worker: a transfer
    whose source blocks cannot be read fails before its payload is
    announced, so the pair stays in step and carries the next transfer."""
    from engine.kv_blocks import KVBlocks
    from kv_transfer.layout import KVLayout
    from kv_transfer.torch_transport import TorchSender
    from rpc.pool import ChannelPool

    decode = workers.decodes[0]
    sp = params(temperature=0, max_tokens=4)
    ticket = await gw.reserve(decode, "read-fails", unique_prompt(100), sp)
    lay = ticket.layout
    cache = [(torch.randn(32, lay.block_size, lay.num_kv_heads, lay.head_dim),
              torch.randn(32, lay.block_size, lay.num_kv_heads, lay.head_dim))
             for _ in range(lay.num_layers)]
    channels = ChannelPool()
    sender = TorchSender(KVBlocks(cache), KVLayout.from_proto(lay), channels,
                         f"test-{uuid.uuid4().hex[:6]}")
    try:
        n = len(ticket.block_ids)
        with pytest.raises(IndexError):  # block 99 of a 32-block cache
            await sender.send("read-fails", ticket, [99] * n)
        assert await gw.abort(decode, "read-fails")  # still reserved, and now free
        (pair,) = sender._groups.values()
        assert not pair.broken
        ticket = await gw.reserve(decode, "read-ok", unique_prompt(100), sp)
        n = len(ticket.block_ids)
        stats = await sender.send("read-ok", ticket, list(range(n)))
        assert stats.bytes == n * KVLayout.from_proto(lay).block_bytes_per_layer * lay.num_layers
        assert list(sender._groups.values()) == [pair] and not pair.broken
        assert await gw.abort(decode, "read-ok")
    finally:
        await sender.close()
        await channels.close()
    await gw.wait_idle(workers.all)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_aborts_at_random_moments_leak_nothing(workers, gw, transport):
    """Cancel or abort requests at random points: computing, transferring,
    or done. Whatever the moment, every block comes back, and the transport
    still works afterwards."""
    rng = random.Random(f"chaos-{transport}")
    sp = params(temperature=0, max_tokens=4, ignore_eos=True)

    async def one(i: int) -> None:
        decode, rid = workers.decodes[i % 2], f"chaos-{transport}-{i}"
        prompt = unique_prompt(rng.choice([20, 100, 250]))
        ticket = await gw.reserve(decode, rid, prompt, sp)
        call = asyncio.ensure_future(
            gw.prefill(workers.prefill, rid, prompt, sp, ticket, transport))
        await asyncio.sleep(rng.uniform(0, 0.2))
        if rng.random() < 0.5:
            call.cancel()
        else:
            await gw.abort(workers.prefill, rid)
        await asyncio.gather(call, return_exceptions=True)
        await gw.abort(decode, rid)

    await asyncio.gather(*(one(i) for i in range(8)))
    await gw.wait_idle(workers.all)
    for i, decode in enumerate(workers.decodes):
        out = await gw.disaggregated(workers.prefill, decode, f"chaos-{transport}-ok-{i}",
                                     unique_prompt(50), sp, transport)
        assert len(out.token_ids) == 4
    await gw.wait_idle(workers.all)


@pytest.mark.parametrize("how", ["abort", "cancel"])
async def test_abort_during_decode_frees_everything(workers, gw, how):
    decode, rid = workers.decodes[0], f"ad-{how}"
    prompt = unique_prompt(60)
    sp = params(temperature=0, max_tokens=600, ignore_eos=True)
    ticket = await gw.reserve(decode, rid, prompt, sp)
    first = await gw.prefill(workers.prefill, rid, prompt, sp, ticket)
    stream = gw.stub(decode).Decode(worker_pb2.DecodeRequest(
        request_id=rid, first_token_id=first.first_token_id, params=sp), timeout=30)
    tokens, reason = [], ""
    while len(tokens) < 2:
        tokens += (await stream.read()).token_ids
    if how == "abort":
        assert await gw.abort(decode, rid)
        while (chunk := await stream.read()) is not grpc.aio.EOF:
            tokens += chunk.token_ids
            reason = chunk.finish_reason
        assert reason == "abort"
    else:
        stream.cancel()
    assert len(tokens) < 600
    await gw.wait_idle(workers.all)


async def test_unused_reservation_expires(workers, gw):
    decode = workers.decodes[1]
    before = metric(scrape(decode.metrics_port), "tandem:kv_reservations_expired_total") or 0
    prompt = unique_prompt(100)
    sp = params(temperature=0, max_tokens=4)
    # A lease long enough that the Info right after surely sees the blocks held.
    ticket = await gw.reserve(decode, "lease", prompt, sp, lease_ms=1500)
    assert (await gw.info(decode)).free_blocks == NUM_BLOCKS - len(ticket.block_ids)
    await gw.wait_idle(workers.all, timeout=10)
    after = metric(scrape(decode.metrics_port), "tandem:kv_reservations_expired_total")
    assert after == before + 1
    # The ticket is dead: the prefill worker refuses it before computing.
    err = await rpc_error(gw.prefill(workers.prefill, "lease", prompt, sp, ticket))
    assert err.code() == StatusCode.ABORTED and "expired" in err.details()
    # Had the prefill not noticed, the decode worker would have refused the KV.
    ticket.lease_expiry_unix_ms = 0
    err = await rpc_error(gw.prefill(workers.prefill, "lease", prompt, sp, ticket))
    assert err.code() == StatusCode.NOT_FOUND and "no reservation" in err.details()
    await gw.wait_idle(workers.all)


async def test_reserve_racing_abort_or_deadline_leaks_nothing(workers, gw):
    """A Reserve whose call is cancelled (deadline) or aborted while its blocks
    are being taken must not leave them held by nobody."""
    decode = workers.decodes[1]
    sp = params(temperature=0, max_tokens=4)
    stub = gw.stub(decode)

    def reserve(rid: str, timeout: float):
        return stub.Reserve(worker_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=unique_prompt(100), params=sp, lease_ms=300),
            timeout=timeout)

    for round in range(3):
        # A migrated request recomputes its 900-token prompt on the decode
        # worker: the reservations queue behind that long step, and the
        # deadlines and aborts land while they wait.
        busy = asyncio.ensure_future(gw.decode(
            decode, f"race-busy-{round}", _with(sp, max_tokens=8), prompt=unique_prompt(900),
            migrated=[7]))
        await asyncio.sleep(0.005)
        calls = []
        for i in range(8):
            rid = f"race-{round}-{i}"
            calls.append(reserve(f"{rid}-deadline", 0.005 * (i + 1)))
            calls.append(reserve(f"{rid}-abort", 10))
            calls.append(gw.abort(decode, f"{rid}-abort"))
        await asyncio.gather(*calls, return_exceptions=True)
        await busy
    await gw.wait_idle(workers.all, timeout=10)  # leases of 300 ms cover what survived


async def test_decode_of_unknown_request_is_not_found(workers, gw):
    decode = workers.decodes[0]
    sp = params(temperature=0, max_tokens=4, ignore_eos=True)
    err = await rpc_error(gw.decode(decode, "never-reserved", sp,
                                    first=worker_pb2.PrefillResponse(first_token_id=5)))
    assert err.code() == StatusCode.NOT_FOUND
    assert "unknown request 'never-reserved'" in err.details()
    assert not await gw.abort(decode, "never-reserved")
    # Still serving.
    out = await gw.disaggregated(workers.prefill, decode, "after-unknown", unique_prompt(30), sp)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    await gw.wait_idle(workers.all)


async def test_request_that_does_not_fit_waits_without_spinning(workers, gw):
    """On a colocated worker, reservations can hold the blocks a request
    needs: it waits, without burning a core, and runs once they are gone."""
    both = workers.both
    sp = params(temperature=0, max_tokens=4, ignore_eos=True)
    holds = [await gw.reserve(both, f"hold-{i}", unique_prompt(n), sp)
             for i, n in enumerate([1000, 480])]  # 63 + 30 of 96 blocks
    waiting = asyncio.ensure_future(gw.colocated(both, "wait-for-room", unique_prompt(400), sp))

    async def queued():
        info = await gw.info(both)
        return info.num_waiting == 3 and not info.num_running

    await wait_until(queued, what="the request to queue")
    before = _cpu_seconds(both)
    await asyncio.sleep(1.0)
    assert _cpu_seconds(both) - before < 0.5, "the engine loop spins while nothing fits"
    assert not waiting.done()
    for t in holds:
        assert await gw.abort(both, t.request_id)
    out = await asyncio.wait_for(waiting, 30)
    assert len(out.token_ids) == 4
    await gw.wait_idle(workers.all)


def _cpu_seconds(w: Worker) -> float:
    import os

    fields = open(f"/proc/{w.proc.popen.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- 3. handshake and validation ------------------------------------------------------------------


async def test_different_model_is_refused_at_handshake(workers, gw):
    other_dir = tiny("llama-mqa-tied")[0]
    prompt = unique_prompt(40)
    sp = params(temperature=0, max_tokens=4)
    ours = (await gw.info(workers.prefill)).layout
    with LocalCluster() as cluster:
        other = start_worker(cluster, "decode", other_dir, NUM_BLOCKS)
        for transport in TRANSPORTS:
            rid = f"mismatch-{transport}"
            ticket = await gw.reserve(other, rid, prompt, sp)
            theirs = ticket.layout
            assert theirs.model_fingerprint != ours.model_fingerprint
            err = await rpc_error(gw.prefill(workers.prefill, rid, prompt, sp, ticket, transport))
            assert err.code() == StatusCode.FAILED_PRECONDITION
            msg = err.details()
            assert "model_fingerprint" in msg and "num_kv_heads" in msg
            for value in (ours.model_fingerprint, theirs.model_fingerprint,
                          ours.num_kv_heads, theirs.num_kv_heads, other.worker_id):
                assert str(value) in msg, (value, msg)
            assert await gw.abort(other, rid)
        # The decode worker refuses a sender of another model too.
        ticket = await gw.reserve(other, "mismatch-push", prompt, sp)
        push = gw.stub(other).PushKV(iter([worker_pb2.KVChunk(
            request_id="mismatch-push", layout=ours, num_blocks=1, data=b"")]), timeout=10)
        err = await rpc_error(push)
        assert err.code() == StatusCode.FAILED_PRECONDITION and "model_fingerprint" in err.details()
        assert await gw.abort(other, "mismatch-push")
        await gw.wait_idle([*workers.all, other])


async def test_bad_params_are_invalid_argument(workers, gw):
    prompt = unique_prompt(20)
    good = params(temperature=0, max_tokens=4)
    decode, prefill, both = workers.decodes[0], workers.prefill, workers.both
    bad = [
        (gw.reserve(decode, "bad-1", prompt, _with(good, temperature=-1.0)), "temperature"),
        (gw.reserve(decode, "bad-2", [600, 1], good), "outside the vocabulary"),
        (gw.reserve(decode, "bad-3", prompt, _with(good, max_tokens=2000)), "max_model_len"),
        (gw.reserve(decode, "bad-4", prompt, _with(good, n=2)), "n=1"),
        (gw.colocated(both, "bad-5", prompt, _with(good, top_p=0.0)), "top_p"),
        (gw.colocated(both, "bad-6", [], good), "empty"),
        (gw.decode(decode, "bad-7", good, prompt=prompt), "only a 'both' worker"),
    ]
    for call, words in bad:
        err = await rpc_error(call)
        assert err.code() == StatusCode.INVALID_ARGUMENT, err.details()
        assert words in err.details(), (words, err.details())
    ticket = await gw.reserve(decode, "bad-8", prompt, good)
    for p, transport, words in [(_with(good, top_k=-2), "grpc", "top_k"),
                                (good, "carrier-pigeon", "unknown transport")]:
        err = await rpc_error(gw.prefill(prefill, "bad-8", prompt, p, ticket, transport))
        assert err.code() == StatusCode.INVALID_ARGUMENT and words in err.details()
    err = await rpc_error(gw.prefill(prefill, "bad-8", prompt + prompt, good, ticket))
    assert err.code() == StatusCode.INVALID_ARGUMENT and "blocks" in err.details()
    assert await gw.abort(decode, "bad-8")
    await gw.wait_idle(workers.all)


def _with(p, **changes):
    q = type(p)()
    q.CopyFrom(p)
    for k, v in changes.items():
        setattr(q, k, v)
    return q


# ---- 4. SIGTERM drains ------------------------------------------------------------------------------


async def test_sigterm_drains_in_flight_requests(model_dir, gw):
    sp = params(temperature=0, max_tokens=900, ignore_eos=True)
    with LocalCluster() as cluster:
        prefill = start_worker(cluster, "prefill", model_dir, NUM_BLOCKS,
                               "--max-num-batched-tokens", "8")
        decode = start_worker(cluster, "decode", model_dir, NUM_BLOCKS)
        # A grace long enough for 900 tokens on a loaded machine: the test is
        # about what a drain does, not about the default grace's length.
        both = start_worker(cluster, "both", model_dir, NUM_BLOCKS, "--grace", "60")

        # A colocated request decoding when the signal comes finishes in full.
        long = asyncio.ensure_future(gw.colocated(both, "drain-long", [5, 6, 7], sp))
        await wait_until(lambda: _running(gw, both), what="the request to start")
        both.proc.popen.send_signal(signal.SIGTERM)

        async def draining():
            return (await gw.info(both)).draining

        await wait_until(draining, what="draining")
        err = await rpc_error(gw.colocated(both, "drain-new", [5, 6], sp))
        assert err.code() == StatusCode.UNAVAILABLE and "draining" in err.details()
        out = await long
        assert len(out.token_ids) == 900 and out.finish_reason == "length"

        # A prefill computing when the signal comes completes and hands off.
        prompt, short = unique_prompt(700), _with(sp, max_tokens=3)
        ticket = await gw.reserve(decode, "drain-prefill", prompt, short)
        call = asyncio.ensure_future(gw.prefill(prefill, "drain-prefill", prompt, short, ticket))
        await wait_until(lambda: _running(gw, prefill), what="the prefill to start")
        prefill.proc.popen.send_signal(signal.SIGTERM)
        first = await call
        out = await gw.decode(decode, "drain-prefill", short, first=first)
        assert out.token_ids[0] == first.first_token_id and len(out.token_ids) == 3

        for w in (both, prefill):
            assert await asyncio.to_thread(w.proc.popen.wait, 15) == 0, w.proc.output()[-3000:]


async def _running(gw: Gateway, w: Worker) -> bool:
    return (await gw.info(w)).num_running > 0
