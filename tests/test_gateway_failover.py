"""Workers die (SIGKILL) under a gateway: before the first token the request is
retried elsewhere, after it the stream migrates to another decode worker
without losing or repeating a token, and with no decode worker left the
stream ends with an error event (never a hang). Dead workers leave rotation;
a gateway that found its workers in Redis forgets them once their
registration expires.

The tests run in file order on one set of workers and each kills some: two
prefill and four decode workers at the start, one decode worker at the end.
"""

from __future__ import annotations

import concurrent.futures

import pytest
from gateway_fixtures import (
    SERVED,
    RedisMonitor,
    cluster_fixture,
    iter_sse,
    redis_db_fixture,
    redis_record,
    sigkill,
    start_gateway,
    start_workers,
    stream_text,
    wait_blocks_free,
    wait_until,
)

from rpc.protos import common_pb2, generation_pb2

DB = 2
NUM_BLOCKS = 64
PROMPT = "the quick brown fox"
LONG = {"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
KILL_AFTER = 30  # stream chunks received before the serving decode worker is killed


url = redis_db_fixture(DB)
cluster = cluster_fixture()


@pytest.fixture(scope="module")
def workers(cluster, url):
    roles = ["prefill", "prefill", "decode", "decode", "decode", "decode"]
    return start_workers(cluster, roles, NUM_BLOCKS, "--state-url", url)


@pytest.fixture(scope="module")
def gateway(cluster, workers, url):
    return start_gateway(cluster, workers, "--state-url", url)


@pytest.fixture(scope="module")
def discovering(cluster, workers, url):
    """A gateway given no workers: it finds them in Redis."""
    gw = start_gateway(cluster, [], "--state-url", url)
    with gw.http() as http:
        wait_until(lambda: sum(w["healthy"] for w in http.get("/health").json()["workers"])
                   == len(workers), 10, "the gateway to discover every worker")
    return gw


@pytest.fixture(scope="module")
def reference(gateway):
    """The greedy text of LONG, and of a short request."""
    with gateway.http() as http:
        long = http.post("/v1/completions", json=LONG).json()["choices"][0]["text"]
        short = http.post("/v1/completions", json={**LONG, "max_tokens": 20}).json()
    return long, short["choices"][0]["text"]


def grpc_request(request_id: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id, text=PROMPT,
        params=common_pb2.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))


def alive(workers, role: str):
    return [w for w in workers if w.proc.role == role and w.proc.alive]


def by_id(workers, worker_id: str):
    return next(w for w in workers if w.worker_id == worker_id)


def test_migration_after_first_token(gateway, workers, url, reference, discovering):
    """Kill the decode worker serving a stream: the stream goes on, on another
    decode worker, and its text is exactly the uninterrupted greedy text.
    (``discovering`` starts here, while every worker is alive.)"""
    with RedisMonitor(url) as monitor:
        with gateway.http() as http, http.stream("POST", "/v1/completions",
                                                 json={**LONG, "stream": True}) as r:
            events = iter_sse(r)
            # Kill right after a chunk whose token made no text: its bytes
            # are half a character the old worker held back, which the new
            # decode worker must still send.
            received = [next(events) for _ in range(5)]
            while received[-1]["choices"][0]["text"] and len(received) < 100:
                received.append(next(events))
            rid = received[0]["id"]
            serving = by_id(workers, redis_record(url, rid)["decode_worker"])
            sigkill(serving)
            received += list(events)
    events = received
    assert not any("error" in e for e in events if isinstance(e, dict)), events[-3:]
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert stream_text(events) == reference[0]
    # The record shows the second attempt on another decode worker.
    final = monitor.writes(rid)[-1]
    assert final["state"] == "FINISHED" and final["attempt"] == "2"
    assert final["tokens_sent"] == "900"
    decoders = [w["decode_worker"] for w in monitor.writes(rid) if "decode_worker" in w]
    assert decoders[0] == serving.worker_id and decoders[-1] != serving.worker_id
    wait_blocks_free(alive(workers, "prefill") + alive(workers, "decode"))


def test_grpc_migration_has_no_duplicate_or_lost_token(gateway, workers, url, reference):
    channel, stub = gateway.generation_stub()
    with channel:
        reference_ids = [t for r in stub.Generate(grpc_request("grpc-ref"), timeout=60)
                         for t in r.token_ids]
        call = stub.Generate(grpc_request("grpc-migrated"), timeout=60)
        replies = [next(call) for _ in range(KILL_AFTER)]
        serving = by_id(workers, redis_record(url, "grpc-migrated")["decode_worker"])
        sigkill(serving)
        replies += list(call)
    assert [t for r in replies for t in r.token_ids] == reference_ids
    assert "".join(r.text for r in replies) == reference[0]
    assert replies[-1].finish_reason == "length"
    assert replies[-1].usage.completion_tokens == 900
    record = redis_record(url, "grpc-migrated")
    assert record["attempt"] == "2" and record["decode_worker"] != serving.worker_id
    wait_blocks_free(alive(workers, "prefill") + alive(workers, "decode"))


def test_retry_before_first_token(gateway, workers, reference):
    """Kill a prefill and a decode worker, then send requests at once, before
    the gateway's health poll notices: every request succeeds elsewhere."""
    sigkill(alive(workers, "prefill")[0])
    sigkill(alive(workers, "decode")[0])
    short = {**LONG, "max_tokens": 20}
    with gateway.http() as http, concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: http.post("/v1/completions", json=short),
                                  range(8)))
    assert [r.status_code for r in responses] == [200] * 8, responses[0].text
    assert {r.json()["choices"][0]["text"] for r in responses} == {reference[1]}
    wait_blocks_free(alive(workers, "prefill") + alive(workers, "decode"))


def test_dead_workers_leave_rotation(gateway, discovering, workers, reference):
    dead = {w.address for w in workers if not w.proc.alive}
    assert len(dead) == 4
    # The static gateway marks them unhealthy (its Info polls fail)...
    with gateway.http() as http:
        wait_until(lambda: {w["address"] for w in http.get("/health").json()["workers"]
                            if not w["healthy"]} == dead, 10, "dead workers to be unhealthy")
    # ...and the discovering one forgets them once their registration expires.
    with discovering.http() as http:
        wait_until(lambda: {w["address"] for w in http.get("/health").json()["workers"]}
                   == {w.address for w in workers if w.proc.alive}, 15,
                   "dead workers' registrations to expire")
        for _ in range(3):
            out = http.post("/v1/completions", json={**LONG, "max_tokens": 20})
            assert out.status_code == 200
            assert out.json()["choices"][0]["text"] == reference[1]


def test_error_event_when_no_decode_worker_is_left(gateway, workers, url):
    """Kill the last decode worker mid-stream: the stream ends with an error
    event and [DONE] (no hang), and the record says FAILED."""
    (last,) = alive(workers, "decode")
    with RedisMonitor(url) as monitor:
        with gateway.http(timeout=30) as http, http.stream(
                "POST", "/v1/chat/completions", json={
                    "model": SERVED, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as r:
            assert r.status_code == 200
            events = iter_sse(r)
            first = next(events)
            sigkill(last)
            rest = list(events)
        wait_until(lambda: "FAILED" in monitor.states(first["id"]), 10, "a FAILED record")
    assert rest[-1] == "[DONE]"
    error = rest[-2]
    assert set(error) == {"error"}, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "server_error"
    assert all("choices" in e for e in rest[:-2])
    assert monitor.states(first["id"])[-1] == "FAILED"
    wait_blocks_free(alive(workers, "prefill"))
    # With no decode worker at all, new requests are refused up front.
    with gateway.http() as http:
        wait_until(lambda: http.post("/v1/completions", json={"prompt": PROMPT}).status_code
                   in (429, 503), 10, "requests to be refused")
