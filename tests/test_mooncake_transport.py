"""The mooncake KV transport between real worker processes, over the
transfer engine's TCP protocol on loopback: a gateway on it gives the
colocated greedy text and leaks no block; written layer by layer, a chunked
prompt's KV gives the same text and the trace shows a write per layer per
chunk; a completion count short by a layer is refused; a decode worker
killed while a transfer waits on it costs the prefill worker nothing and
the gateway retries; a transport that cannot start (protocol rdma without
an RDMA NIC) falls back to grpc, logged and counted.

Needs the ``mooncake-transfer-engine-non-cuda`` wheel and Debian's
``libibverbs1``/``librdmacm1`` (scripts/install_rdma_libs.sh).
"""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from gateway_fixtures import (
    assert_layer_spans,
    info,
    sigkill,
    start_gateway,
    start_workers,
    tiny_model,
    traced_cluster_fixture,
    wait_blocks_free,
    wait_until,
)
from worker_fixtures import Gateway, metric, params, refused_start, scrape, start_worker

pytest.importorskip("mooncake.engine", reason="the mooncake wheel or its RDMA libraries "
                    "are missing (scripts/install_rdma_libs.sh)")

NUM_BLOCKS = 64
MOONCAKE = ("--transport", "mooncake,grpc")
# Prefill workers compute prompts in 16-token chunks: the one write after the
# prompt (a CPU's default) comes after several steps, and written by layer a
# prompt's KV goes over several steps.
CHUNKED = ("--long-prefill-token-threshold", "16", "--max-num-batched-tokens", "16")
BY_LAYER = ("--kv-layer-writes", "on", *CHUNKED)
PROMPTS = ["the quick brown fox", "a" * 150, "tandem " * 30]


trace_file, cluster = traced_cluster_fixture()


@pytest.fixture(scope="module")
def workers(cluster):
    """A prefill worker and two decode workers on mooncake, and a colocated one."""
    disagg = start_workers(cluster, ["prefill"], NUM_BLOCKS, *MOONCAKE, *CHUNKED, metrics=True)
    disagg += start_workers(cluster, ["decode", "decode"], NUM_BLOCKS, *MOONCAKE, metrics=True)
    both = start_workers(cluster, ["both"], NUM_BLOCKS)
    return disagg + both


@pytest.fixture(scope="module")
def by_layer(cluster):
    return start_worker(cluster, "prefill", tiny_model(), NUM_BLOCKS, *MOONCAKE, *BY_LAYER)


@pytest.fixture(scope="module")
def gateway(cluster, workers):
    return start_gateway(cluster, workers[:3], "--transport", "mooncake")


@pytest.fixture(scope="module")
def colocated(cluster, workers):
    return start_gateway(cluster, workers[3:])


def complete(gw, prompt: str, max_tokens: int = 24) -> str:
    with gw.http() as http:
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_segments_move_exactly_the_named_blocks():
    """Two registered caches in this process: the planned batch write puts
    each source block's K and V of every layer into its destination block,
    merges consecutive runs, and touches no other block."""
    import torch

    from engine.kv_blocks import KVBlocks
    from kv_transfer.mooncake_endpoint import MooncakeEndpoint

    shape = (12, 4, 2, 8)
    src = KVBlocks([(torch.randn(shape), torch.randn(shape)) for _ in range(3)])
    dst = KVBlocks([(torch.zeros(shape), torch.zeros(shape)) for _ in range(3)])
    a, b = MooncakeEndpoint(src, "127.0.0.1"), MooncakeEndpoint(dst, "127.0.0.1")
    try:
        from_ids, to_ids = [2, 3, 4, 9, 0], [5, 6, 7, 1, 11]
        segs = a.segments(b.target(), from_ids, to_ids)
        assert len(segs[0]) == 6 * 3  # 3 runs in each of 6 regions
        a.write(b.rpc_address, *segs)
        assert torch.equal(dst.read(to_ids), src.read(from_ids))
        others = [i for i in range(12) if i not in to_ids]
        assert not dst.read(others).any()
    finally:
        a.close()
        b.close()


def test_a_write_of_more_segments_than_the_lanes_hold_lands_whole():
    """A long prompt in a fragmented cache is tens of thousands of segments.
    Submitted all at once, the engine's TCP lanes refused those past their
    queues' room, and the segments still queued stayed pending for good:
    every later write failed. At most MAX_IN_FLIGHT go at a time now."""
    import torch

    from engine.kv_blocks import KVBlocks
    from kv_transfer.mooncake_endpoint import MAX_IN_FLIGHT, MooncakeEndpoint

    shape = (1200, 4, 1, 8)
    src = KVBlocks([(torch.randn(shape), torch.randn(shape)) for _ in range(6)])
    dst = KVBlocks([(torch.zeros(shape), torch.zeros(shape)) for _ in range(6)])
    a, b = MooncakeEndpoint(src, "127.0.0.1"), MooncakeEndpoint(dst, "127.0.0.1")
    try:
        from_ids, to_ids = list(range(0, 1200, 2)), list(range(1, 1200, 2))  # no runs merge
        segs = a.segments(b.target(), from_ids, to_ids)
        assert len(segs[0]) == 12 * 600 > 8 * MAX_IN_FLIGHT
        for _ in range(2):
            a.write(b.rpc_address, *segs)
            assert torch.equal(dst.read(to_ids), src.read(from_ids))
        small = a.segments(b.target(), [5], [6])
        a.write(b.rpc_address, *small)
        assert torch.equal(dst.read([6]), src.read([5]))
    finally:
        a.close()
        b.close()


def _thread_cores(pid: int | str = "self") -> dict[int, set[int]]:
    """Each thread of a process and the cores it may run on, from /proc."""
    import os

    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # it ended
            pass
    return out


def test_an_endpoint_given_cores_runs_its_engine_threads_there():
    """The threads each engine starts, and the one that submits and polls
    its writes, run on the endpoint's cores only; the process's other
    threads keep theirs; the pinned engines still move the blocks."""
    import os

    import torch

    from engine.kv_blocks import KVBlocks
    from kv_transfer.mooncake_endpoint import MooncakeEndpoint

    cpus = sorted(os.sched_getaffinity(0))
    shape = (4, 4, 2, 8)
    src = KVBlocks([(torch.randn(shape), torch.randn(shape))])
    dst = KVBlocks([(torch.zeros(shape), torch.zeros(shape))])
    before = _thread_cores()
    a = MooncakeEndpoint(src, "127.0.0.1", cores=[cpus[0]])
    started_a = set(_thread_cores()) - set(before)
    b = MooncakeEndpoint(dst, "127.0.0.1", cores=[cpus[-1]])
    try:
        now = _thread_cores()
        started_b = set(now) - set(before) - started_a
        assert started_a and started_b, "each engine starts threads of its own"
        assert all(now[t] == {cpus[0]} for t in started_a if t in now)
        assert all(now[t] == {cpus[-1]} for t in started_b if t in now)
        assert all(now[t] == before[t] for t in before if t in now)
        # The thread that submits and polls the writes runs there too.
        assert a.thread.submit(os.sched_getaffinity, 0).result() == {cpus[0]}
        a.write(b.rpc_address, *a.segments(b.target(), [0, 1, 2, 3], [3, 2, 1, 0]))
        assert torch.equal(dst.read([3, 2, 1, 0]), src.read([0, 1, 2, 3]))
    finally:
        a.close()
        b.close()


def test_a_worker_runs_its_engine_threads_where_it_is_told(cluster):
    """Placed as ``tandem up`` places a 1P+1D pair (``--cpu-cores`` with
    ``--borrow-cores``): by default the mooncake engine's threads may run
    wherever the worker may; with ``--mooncake-cores`` on those cores only."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores: one owned, one to borrow")
    own, both = cpus[-1], {cpus[0], cpus[-1]}
    placed = ("--cpu-cores", str(own), "--borrow-cores", f"{cpus[0]},{cpus[-1]}")
    free = start_worker(cluster, "decode", tiny_model(), NUM_BLOCKS, *MOONCAKE, *placed)
    told = start_worker(cluster, "decode", tiny_model(), NUM_BLOCKS, *MOONCAKE, *placed,
                        "--mooncake-cores", str(own))
    try:
        for worker in (free, told):
            threads = _thread_cores(worker.proc.popen.pid)
            assert threads[worker.proc.popen.pid] == both  # the main thread
            # Only the engine's threads are ever kept to one core.
            assert ({own} in threads.values()) == (worker is told)
    finally:
        free.proc.terminate()
        told.proc.terminate()


@pytest.mark.parametrize("flags, error", [
    (("--transport", "grpc", "--mooncake-cores", "0"),
     "--mooncake-cores needs mooncake in --transport"),
    (("--transport", "mooncake", "--mooncake-cores", "4095"),
     "--mooncake-cores: cores 4095 are not available to this process"),
    (("--transport", "mooncake", "--mooncake-cores", "1-0"), "bad core range"),
])
def test_bad_mooncake_cores_are_refused_before_the_model_loads(flags, error):
    assert error in refused_start(*flags)


def test_under_tls_mooncake_is_refused_unless_allowed():
    """Not encrypted, and its port writes into the cache: like torch, off
    under TLS without --tls-allow-torch-transport; the next one stands in."""
    import torch

    from engine.kv_blocks import KVBlocks
    from kv_transfer.mooncake_endpoint import TransportUnavailable
    from worker.metrics import WorkerMetrics
    from worker.transports import TransportConfig, Transports

    io = KVBlocks([(torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8))])
    metrics = WorkerMetrics("w", "prefill")
    refused = Transports(TransportConfig(("mooncake", "grpc")), io, False, metrics)
    assert refused.started == ["grpc"] and refused.mooncake is None
    assert metrics.registry.get_sample_value(
        "tandem:kv_transport_fallbacks_total",
        {"wanted": "mooncake", "used": "grpc", "when": "start"}) == 1
    with pytest.raises(TransportUnavailable, match="names none after it"):
        Transports(TransportConfig(("mooncake",)), io, False, metrics)
    allowed = Transports(TransportConfig(("mooncake", "grpc")), io, True, metrics)
    try:
        assert allowed.started == ["mooncake", "grpc"] and allowed.mooncake is not None
    finally:
        allowed.close()


def test_workers_advertise_mooncake(workers):
    for w in workers[:3]:
        assert "mooncake" in info(w.address).transports
    assert "mooncake" not in info(workers[3].address).transports


def test_mooncake_gives_the_colocated_text_and_frees_every_block(workers, gateway, colocated):
    prefill, *decodes = workers[:3]
    for prompt in PROMPTS:
        assert complete(gateway, prompt) == complete(colocated, prompt)
    wait_blocks_free(workers)
    # The KV really went over mooncake: counted on both sides, no fallback.
    sent = scrape(prefill.metrics_port)
    assert metric(sent, "tandem:kv_transfer_bytes_total", transport="mooncake",
                  direction="send") > 0
    assert metric(sent, "tandem:kv_transport_fallbacks_total") is None
    received = sum(metric(scrape(d.metrics_port), "tandem:kv_transfer_bytes_total",
                          transport="mooncake", direction="recv") or 0 for d in decodes)
    assert received == metric(sent, "tandem:kv_transfer_bytes_total", transport="mooncake",
                              direction="send")
    assert metric(sent, "tandem:kv_transport_bandwidth_bytes_per_second",
                  transport="mooncake") > 0


async def test_layer_writes_follow_the_chunks_in_the_trace(workers, by_layer, trace_file):
    """A 100-token prompt in 7 chunks: one write per layer per chunk, each
    one block further and after that layer computed it, all under the
    transfer's span; the decode worker continues as the colocated one."""
    prefill, decode, both = by_layer, workers[1], workers[3]
    prompt, p = list(range(3, 103)), params(max_tokens=6, temperature=0.0, ignore_eos=True)
    async with Gateway() as gw:
        out = await gw.disaggregated(prefill, decode, "traced", prompt, p, "mooncake")
        local = await gw.decode(both, "traced-local", p, prompt=prompt)
    assert out.token_ids == local.token_ids and len(out.token_ids) == 6

    assert_layer_spans(trace_file, "traced", "kv_transfer.layer_write", 2, 7)
    wait_blocks_free([by_layer, decode])


async def test_a_completion_count_that_does_not_match_is_refused(workers):
    """A writer that reports fewer bytes than the reservation holds: the decode
    worker refuses to start the request, and the reservation stays abortable."""
    from rpc.protos import worker_pb2

    decode = workers[1]
    prompt, p = list(range(5, 45)), params(max_tokens=4, temperature=0.0)
    async with Gateway() as gw:
        ticket = await gw.reserve(decode, "short-count", prompt, p)
        call = gw.stub(decode).WriteKV()
        await call.write(worker_pb2.WriteKVMessage(begin=worker_pb2.WriteKVBegin(
            request_id="short-count", prefill_worker_id="test", layout=ticket.layout,
            num_blocks=len(ticket.block_ids), attempt=0)))
        assert (await call.read()).ready
        await call.write(worker_pb2.WriteKVMessage(done=worker_pb2.WriteKVDone(
            bytes_written=1, num_blocks=len(ticket.block_ids))))
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "expected" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await gw.decode(decode, "short-count", p, first=worker_pb2.PrefillResponse())
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        await gw.abort(decode, "short-count")
    wait_blocks_free([decode])


async def test_a_layer_that_missed_blocks_is_refused(workers):
    """Written layer by layer, the done message counts each layer's blocks:
    one layer short and the decode worker refuses, whatever the byte count."""
    from kv_transfer.layout import KVLayout
    from rpc.protos import worker_pb2

    decode = workers[1]
    prompt, p = list(range(5, 45)), params(max_tokens=4, temperature=0.0)
    async with Gateway() as gw:
        ticket = await gw.reserve(decode, "short-layer", prompt, p)
        layout, n = KVLayout.from_proto(ticket.layout), len(ticket.block_ids)
        call = gw.stub(decode).WriteKV()
        await call.write(worker_pb2.WriteKVMessage(begin=worker_pb2.WriteKVBegin(
            request_id="short-layer", prefill_worker_id="test", layout=ticket.layout,
            num_blocks=n, attempt=0)))
        assert (await call.read()).ready
        await call.write(worker_pb2.WriteKVMessage(done=worker_pb2.WriteKVDone(
            bytes_written=n * layout.block_bytes_per_layer * layout.num_layers, num_blocks=n,
            layer_blocks=[n] * (layout.num_layers - 1) + [n - 1])))
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "by layer" in err.value.details()
        await gw.abort(decode, "short-layer")
    wait_blocks_free([decode])


async def test_decode_killed_mid_transfer_frees_the_prefill_blocks(cluster, workers):
    """The decode worker is stopped with its blocks reserved, so the prefill
    worker's transfer waits on it; killed then, the transfer fails with a
    status the gateway retries, and the prefill worker holds nothing."""
    prefill = workers[0]
    victim = start_worker(cluster, "decode", tiny_model(), NUM_BLOCKS, *MOONCAKE)
    prompt, p = list(range(3, 200)), params(max_tokens=4, temperature=0.0)
    async with Gateway() as gw:
        err = await gw.prefill_into_a_killed_worker(prefill, victim, "killed-mid", prompt, p,
                                                    "mooncake")
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    wait_blocks_free([prefill])


def test_gateway_retries_when_a_decode_worker_dies(workers, gateway, colocated):
    """A decode worker killed just before requests arrive: those sent its way
    fail over to the other one before their first token; all succeed."""
    sigkill(workers[2])
    prompt = PROMPTS[0]
    expected = complete(colocated, prompt, 16)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: complete(gateway, prompt, 16), range(6)))
    assert texts == [expected] * 6
    wait_blocks_free(workers[:2])


async def test_fallback_when_mooncake_cannot_start_is_logged_and_counted(cluster, workers):
    """Protocol rdma on a host without an RDMA NIC: the worker starts on grpc,
    says so, counts it, and a request for mooncake is served over grpc (counted)."""
    prefill = start_worker(cluster, "prefill", tiny_model(), NUM_BLOCKS, *MOONCAKE,
                           "--mooncake-protocol", "rdma", metrics=True)
    assert "mooncake" not in info(prefill.address).transports
    wait_until(lambda: "KV transport mooncake cannot start" in prefill.proc.output(), 5,
               "the fallback's log line")
    text = scrape(prefill.metrics_port)
    assert metric(text, "tandem:kv_transport_fallbacks_total", wanted="mooncake",
                  used="grpc", when="start") == 1
    decode, prompt = workers[1], list(range(7, 60))
    p = params(max_tokens=3, temperature=0.0)
    async with Gateway() as gw:
        out = await gw.disaggregated(prefill, decode, "fallback", prompt, p, "mooncake")
    assert out.finish_reason == "length"
    text = scrape(prefill.metrics_port)
    assert metric(text, "tandem:kv_transport_fallbacks_total", wanted="mooncake",
                  used="grpc", when="request") == 1
    assert metric(text, "tandem:kv_transfer_bytes_total", transport="grpc",
                  direction="send") > 0
    wait_blocks_free([prefill, decode])
