"""The torch KV transport layer by layer (``--kv-layer-writes on``) between
real worker processes over gloo: a chunked prompt's KV goes out one payload
per layer per chunk, each after that layer computed it (the trace shows
it); the decode worker continues exactly as a colocated one, also with
several requests streaming through the pair's one frame channel at once;
an abort at any moment of it leaks nothing, and the pair keeps working; a
decode worker killed mid-transfer costs the prefill worker nothing.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from gateway_fixtures import (
    assert_layer_spans,
    tiny_model,
    traced_cluster_fixture,
    wait_blocks_free,
)
from worker_fixtures import Gateway, metric, params, scrape, start_worker_set

NUM_BLOCKS = 96
TORCH = ("--transport", "torch,grpc")
# 16-token chunks: a prompt's KV leaves over several steps, layer by layer.
BY_LAYER = ("--kv-layer-writes", "on", "--long-prefill-token-threshold", "16",
            "--max-num-batched-tokens", "16")


trace_file, cluster = traced_cluster_fixture()


@pytest.fixture(scope="module")
def workers(cluster):
    """A prefill worker sending by layer, a decode worker, and a colocated one."""
    return start_worker_set(cluster, [("prefill", (*TORCH, *BY_LAYER)), ("decode", TORCH),
                                      ("both", ())], tiny_model(), NUM_BLOCKS, metrics=True)


async def test_layer_sends_follow_the_chunks_in_the_trace(workers, trace_file):
    """A 100-token prompt in 7 chunks: one payload per layer per chunk, each
    one block further and after that layer computed it, all under the
    transfer's span; the decode worker continues as the colocated one."""
    prefill, decode, both = workers
    prompt, p = list(range(3, 103)), params(max_tokens=6, temperature=0.0, ignore_eos=True)
    async with Gateway() as gw:
        out = await gw.disaggregated(prefill, decode, "traced", prompt, p, "torch")
        local = await gw.decode(both, "traced-local", p, prompt=prompt)
    assert out.token_ids == local.token_ids and len(out.token_ids) == 6

    span = assert_layer_spans(trace_file, "traced", "kv_transfer.layer_send", 2, 7)
    assert span["attributes"]["transport"] == "torch"
    wait_blocks_free([prefill, decode])


async def test_requests_interleaved_on_the_pair_match_colocated(workers):
    """Six prompts at once: their layers' payloads interleave on the pair's
    one frame channel, and each lands in its own blocks."""
    prefill, decode, both = workers
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (20, 100, 47, 130, 64, 9)]
    p = params(max_tokens=5, temperature=0.0, ignore_eos=True)
    async with Gateway() as gw:
        outs = await asyncio.gather(*(
            gw.disaggregated(prefill, decode, f"many-{i}", prompt, p, "torch")
            for i, prompt in enumerate(prompts)))
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            local = await gw.decode(both, f"many-local-{i}", p, prompt=prompt)
            assert out.token_ids == local.token_ids, i
    sent = scrape(prefill.metrics_port)
    assert metric(sent, "tandem:kv_transport_fallbacks_total") is None
    assert metric(sent, "tandem:kv_transfer_bytes_total", transport="torch",
                  direction="send") > 0
    wait_blocks_free([prefill, decode])


async def test_aborts_mid_stream_leak_nothing_and_the_pair_goes_on(workers):
    """Abort requests at random moments while their layers stream: every
    block comes back on both sides, and the next transfer still works."""
    prefill, decode, both = workers
    rng = random.Random("torch-layers")
    p = params(max_tokens=4, temperature=0.0, ignore_eos=True)
    async with Gateway() as gw:

        async def one(i: int) -> None:
            rid = f"abort-{i}"
            prompt = [rng.randrange(3, 250) for _ in range(rng.choice([30, 120, 200]))]
            ticket = await gw.reserve(decode, rid, prompt, p)
            call = asyncio.ensure_future(gw.prefill(prefill, rid, prompt, p, ticket, "torch"))
            await asyncio.sleep(rng.uniform(0, 0.3))
            await gw.abort(prefill, rid)
            await gw.abort(decode, rid)
            await asyncio.gather(call, return_exceptions=True)

        await asyncio.gather(*(one(i) for i in range(8)))
        await gw.wait_idle([prefill, decode], timeout=30)
        prompt = list(range(7, 90))
        out = await gw.disaggregated(prefill, decode, "after", prompt, p, "torch")
        local = await gw.decode(both, "after-local", p, prompt=prompt)
        assert out.token_ids == local.token_ids
    wait_blocks_free([prefill, decode])


async def test_decode_killed_mid_transfer_frees_the_prefill_blocks(cluster, workers):
    """A decode worker that already shares a pair with the prefill worker is
    stopped, then killed while a transfer waits on it: the transfer fails
    with a status the gateway retries, the prefill worker holds nothing,
    and its transfers to other decode workers go on."""
    prefill, decode, both = workers
    victim = start_worker_set(cluster, [("decode", TORCH)], tiny_model(), NUM_BLOCKS)[0]
    prompt, p = list(range(3, 200)), params(max_tokens=4, temperature=0.0, ignore_eos=True)
    async with Gateway() as gw:
        await gw.disaggregated(prefill, victim, "before-kill", prompt, p, "torch")
        err = await gw.prefill_into_a_killed_worker(prefill, victim, "killed-mid", prompt, p,
                                                    "torch")
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
        out = await gw.disaggregated(prefill, decode, "after-kill", prompt, p, "torch")
        local = await gw.decode(both, "after-kill-local", p, prompt=prompt)
        assert out.token_ids == local.token_ids
    wait_blocks_free([prefill, decode])


class _InOrder:
    """Runs posts one at a time in order, as a pair's frame channel does,
    recording the frames whose payload was read (and would be sent)."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1)
        self.sent: list[int] = []

    def post(self, frame, read, sent):
        def run():
            data = read()
            self.sent.append(frame.data.layer)
            sent(data.numel() * data.element_size(), 0)
            return data.numel()
        return self.pool.submit(run)


async def test_sends_queued_when_the_sink_closes_are_dropped_unread():
    """A transfer that fails or is cancelled closes its sink: posts still in
    the channel's queue are neither read nor announced (before, every one of
    them was read out of the cache and sent to be thrown away)."""
    import threading

    import torch

    from engine.kv_blocks import KVBlocks
    from kv_transfer.torch_layers import Cancelled, LayerSends

    caches = [(torch.randn(8, 4, 2, 8), torch.randn(8, 4, 2, 8)) for _ in range(4)]
    sends = LayerSends(KVBlocks(caches), "r", 1, num_blocks=2, num_layers=4)
    channel = sends.channel = _InOrder()
    gate = threading.Event()
    channel.pool.submit(gate.wait)  # the channel is busy: every post queues behind this
    sends.start()
    sends.begin_step([3, 5], 2)
    for layer in range(4):
        sends.layer_done(layer)
    sends.close()
    gate.set()
    await sends.settle()
    assert channel.sent == []
    assert all(isinstance(f.exception(), Cancelled) for f in sends.futures)
    assert len(sends.futures) == 4 and sends.landed == [0] * 4
