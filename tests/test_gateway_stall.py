"""A decode stream that stops making progress moves to another worker.

End to end: a decode worker frozen with SIGSTOP (it neither dies nor answers)
under a live stream; the gateway drops it from rotation and the stream goes
on elsewhere with exactly the uninterrupted text, and once the worker runs
again it frees everything. Then the rule itself (gateway/stall.py) against a
real gRPC stream: a quiet stream on a worker that keeps stepping waits; one
on a worker that stopped stepping, or left rotation, is cancelled.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from gateway_fixtures import (
    cluster_fixture,
    info,
    iter_sse,
    start_gateway,
    start_workers,
    stream_text,
    wait_blocks_free,
    wait_until,
)
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.router import WorkerView
from gateway.stall import StallWatch, stall_window

LONG = {"prompt": "the quick brown fox", "max_tokens": 600, "temperature": 0,
        "ignore_eos": True}

cluster = cluster_fixture()


@pytest.fixture(scope="module")
def workers(cluster):
    return start_workers(cluster, ["prefill", "decode", "decode"], 64)


@pytest.fixture(scope="module")
def gateway(cluster, workers):
    return start_gateway(cluster, workers, "--stall-timeout-s", "2")


def test_frozen_decode_worker_has_its_stream_moved(gateway, workers):
    with gateway.http(timeout=60) as http:
        reference = http.post("/v1/completions", json=LONG).json()["choices"][0]["text"]
        wait_blocks_free(workers)
        decoders = [w for w in workers if w.proc.role == "decode"]
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            events = iter_sse(r)
            received = [next(events) for _ in range(20)]
            (serving,) = [w for w in decoders if info(w.address).num_running]
            serving.proc.popen.send_signal(signal.SIGSTOP)
            try:
                # Without the move this read hangs until the client's timeout.
                received += list(events)
            finally:
                serving.proc.popen.send_signal(signal.SIGCONT)
    assert received[-1] == "[DONE]"
    assert not any("error" in e for e in received if isinstance(e, dict)), received[-3:]
    assert stream_text(received) == reference
    # Resumed, the frozen worker finds its call cancelled and frees the blocks.
    wait_blocks_free(workers)
    # And it serves again once the gateway's polls see it answer.
    with gateway.http() as http:
        wait_until(lambda: all(w["healthy"] for w in http.get("/health").json()["workers"]),
                   10, "the resumed worker back in rotation")


# ---- the rule, against a real stream -------------------------------------------------


async def _watch_for(worker: WorkerView, floor_s: float, seconds: float,
                     keep_stepping: bool = False, leave_after: float | None = None):
    """Runs a StallWatch over a real (never-ending) server stream for up to
    ``seconds``; returns its reason (None: it let the stream be)."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    watch = StallWatch(worker, floor_s, call)

    async def worker_life():
        start = time.monotonic()
        while True:
            await asyncio.sleep(0.05)
            if keep_stepping:
                worker.stepped_at = time.monotonic()
            if leave_after is not None and time.monotonic() - start > leave_after:
                worker.left.set()

    life = asyncio.ensure_future(worker_life())
    try:
        async def read():
            async for _ in call:
                pass

        await asyncio.wait_for(read(), seconds)
    except asyncio.CancelledError:
        assert watch.reason is not None  # cancelled by the watch, not by us
    except TimeoutError:
        assert watch.reason is None
    finally:
        life.cancel()
        watch.close()
        await channel.close()
        await server.stop(None)
    return watch.reason


def test_a_quiet_stream_on_a_stepping_worker_waits():
    worker = WorkerView("w:1", healthy=True)
    assert asyncio.run(_watch_for(worker, 0.3, 2.0, keep_stepping=True)) is None


def test_a_stream_on_a_worker_that_stopped_stepping_is_given_up():
    worker = WorkerView("w:1", healthy=True, stepped_at=time.monotonic())
    reason = asyncio.run(_watch_for(worker, 0.3, 10.0))
    assert "no engine step" in reason


def test_a_stream_on_a_worker_that_left_rotation_is_given_up():
    worker = WorkerView("w:1", healthy=True)
    reason = asyncio.run(_watch_for(worker, 30.0, 10.0, keep_stepping=True, leave_after=0.2))
    assert "left rotation" in reason


def test_the_window_follows_the_workers_own_step_time():
    worker = WorkerView("w:1", healthy=True, step_s=0.5)
    assert stall_window(worker, 0.3) == 10.0  # 20 steps of 0.5 s, over the 0.3 s floor
    assert stall_window(WorkerView("w:2", step_s=0.001), 0.3) == 0.3
    # A worker that stopped stepping 2 s ago with 0.5 s steps is slow, not stuck.
    worker.stepped_at = time.monotonic() - 2.0
    assert asyncio.run(_watch_for(worker, 0.3, 1.0)) is None
