"""Two prefill and two decode workers behind a gateway that keeps request
state in Redis: the load is shared, each request's record goes through its
states with worker ids, attempt and tokens sent, finished records expire,
fenced updates are dropped, and workers registered in Redis are found by a
gateway that was given none."""

from __future__ import annotations

import concurrent.futures
import json
import random

import pytest
import redis
from gateway_fixtures import (
    SERVED,
    RedisMonitor,
    cluster_fixture,
    iter_sse,
    redis_db_fixture,
    redis_record,
    redis_url,
    start_gateway,
    start_workers,
    wait_blocks_free,
    wait_until,
)
from worker_fixtures import metric, scrape

from gateway.state import MemoryStore, RedisStore, State

DB = 1
NUM_BLOCKS = 64
PROMPT = "the quick brown fox"


url = redis_db_fixture(DB)
cluster = cluster_fixture()


@pytest.fixture(scope="module")
def workers(cluster, url):
    return start_workers(cluster, ["prefill", "prefill", "decode", "decode"], NUM_BLOCKS,
                         "--state-url", url, metrics=True)


@pytest.fixture(scope="module")
def gateway(cluster, workers, url):
    return start_gateway(cluster, workers, "--state-url", url, "--finished-ttl", "1")


@pytest.fixture(scope="module")
def client(gateway):
    with gateway.client() as c:
        yield c


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "workers" in request.fixturenames:
        wait_blocks_free(request.getfixturevalue("workers"))


def _ids(workers, role: str) -> set[str]:
    return {w.worker_id for w in workers if w.proc.role == role}


def test_load_is_shared(client, workers, url):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(16)]

    def ask(prompt):
        return client.completions.create(model=SERVED, prompt=prompt, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})

    with RedisMonitor(url) as monitor, concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(ask, prompts))
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    used = {"prefill": set(), "decode": set()}
    for o in outs:
        for w in monitor.writes(o.id):
            if "prefill_worker" in w:
                used["prefill"].add(w["prefill_worker"])
            if "decode_worker" in w:
                used["decode"].add(w["decode_worker"])
    assert used["prefill"] == _ids(workers, "prefill")
    assert used["decode"] == _ids(workers, "decode")
    # The workers' own metrics agree: each decode worker finished some,
    # each prefill worker sent some KV.
    for w in workers:
        text = scrape(w.metrics_port)
        if w.proc.role == "decode":
            assert (metric(text, "vllm:request_success_total", finished_reason="length")
                    or 0) > 0, w.worker_id
        else:
            assert (metric(text, "tandem:kv_transfer_bytes_total", transport="grpc",
                           direction="send") or 0) > 0, w.worker_id


def test_record_goes_through_its_states(client, workers, url):
    with RedisMonitor(url) as monitor:
        out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=9, seed=11,
                                        temperature=0, extra_body={"ignore_eos": True})
    rid = out.id
    assert monitor.states(rid) == ["QUEUED", "PREFILLING", "DECODING", "FINISHED"]
    writes = monitor.writes(rid)
    created = writes[0]
    assert created["attempt"] == "0" and created["prompt_tokens"] == str(out.usage.prompt_tokens)
    params = json.loads(created["params"])
    assert params["seed"] == 11 and params["max_tokens"] == 9 and params["temperature"] == 0
    prefilling = next(w for w in writes if w.get("state") == "PREFILLING")
    decoding = next(w for w in writes if w.get("state") == "DECODING")
    finished = writes[-1]
    assert prefilling["prefill_worker"] in _ids(workers, "prefill")
    assert decoding["decode_worker"] in _ids(workers, "decode")
    assert prefilling["attempt"] == decoding["attempt"] == finished["attempt"] == "1"
    assert finished["state"] == "FINISHED" and finished["tokens_sent"] == "9"


def test_finished_record_expires_after_ttl(client, url):
    out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3)
    r = redis.Redis.from_url(url)
    try:
        # Written before the response: a TTL of --finished-ttl (1 s), or already gone.
        ttl = r.pttl(f"tandem:req:{out.id}")
        assert ttl == -2 or 0 <= ttl <= 1000, ttl
        wait_until(lambda: not r.exists(f"tandem:req:{out.id}"), 5, "the record to expire")
    finally:
        r.close()


def test_running_record_and_abort_on_disconnect(gateway, workers, url):
    with RedisMonitor(url) as monitor:
        with gateway.http() as http, http.stream("POST", "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            events = iter_sse(r)
            rid = next(events)["id"]
            running = redis_record(url, rid)
            # Mid-stream: decoding on a known worker; no expiry yet beyond the safety net.
            assert running["state"] == "DECODING"
            assert running["decode_worker"] in _ids(workers, "decode")
            assert running["prefill_worker"] in _ids(workers, "prefill")
        wait_until(lambda: "ABORTED" in monitor.states(rid), 10, "the record to be ABORTED")
    states = monitor.states(rid)
    assert states[-1] == "ABORTED" and states[:3] == ["QUEUED", "PREFILLING", "DECODING"]
    last = monitor.writes(rid)[-1]
    assert 0 < int(last["tokens_sent"]) < 900


def test_n_2_records_each_completion_and_the_total(client, url):
    with RedisMonitor(url) as monitor:
        out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, n=2,
                                        seed=1, extra_body={"ignore_eos": True})
    writes = monitor.writes(out.id)
    assert writes[-1]["state"] == "FINISHED" and writes[-1]["tokens_sent"] == "8"
    # The request's record follows both completions, unfenced (attempt 0)...
    assert sum(w.get("state") == "PREFILLING" for w in writes) == 2
    assert all(w.get("attempt", "0") == "0" for w in writes)
    # ...and each completion has its own record, fenced on its own attempts.
    for i in range(2):
        own = monitor.writes(f"{out.id}#{i}")
        assert monitor.states(f"{out.id}#{i}") == ["QUEUED", "PREFILLING", "DECODING", "FINISHED"]
        assert own[0]["parent"] == out.id and own[0]["index"] == str(i)
        assert own[-1]["tokens_sent"] == "4" and own[-1]["attempt"] == "1"


def test_workers_register_with_a_heartbeat(workers, url):
    r = redis.Redis.from_url(url, decode_responses=True)
    try:
        for w in workers:
            key = f"tandem:worker:{w.worker_id}"
            record = json.loads(r.get(key))
            assert record == {"worker_id": w.worker_id, "role": w.proc.role,
                              "address": w.address}
            # It expires unless renewed: a dead worker's registration goes away.
            assert 0 < r.ttl(key) <= 3
        # ...and it is renewed.
        key = f"tandem:worker:{workers[0].worker_id}"
        wait_until(lambda: r.pttl(key) > 2500, 5, "a heartbeat to renew the registration")
    finally:
        r.close()


def test_discovery_from_redis(cluster, workers, url):
    discovering = start_gateway(cluster, [], "--state-url", url)
    try:
        with discovering.http() as http:
            def found():
                body = http.get("/health").json()
                healthy = {w["worker_id"] for w in body["workers"] if w["healthy"]}
                return healthy == {w.worker_id for w in workers}
            wait_until(found, 10, "the gateway to find all four workers in Redis")
        with discovering.client() as client:
            out = client.chat.completions.create(
                model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                temperature=0, extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 5
    finally:
        discovering.proc.terminate()


# ---- fencing ---------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        s = MemoryStore(finished_ttl_s=1)
    else:
        s = RedisStore(redis_url(DB), finished_ttl_s=1)
    yield s
    await s.close()


async def test_fencing_drops_older_attempts(store):
    rid = f"fence-{random.randrange(1 << 30)}"
    await store.create(rid, {"prompt_tokens": 3, "tokens_sent": 0})
    record = await store.get(rid)
    assert record["state"] == "QUEUED" and record["attempt"] == "0"
    assert await store.update(rid, 1, {"state": State.PREFILLING, "prefill_worker": "p1"})
    assert await store.update(rid, 2, {"state": State.DECODING, "decode_worker": "d2"})
    # A late write from attempt 1 (a worker presumed dead) is dropped.
    assert not await store.update(rid, 1, {"state": State.FAILED, "decode_worker": "d1"})
    record = await store.get(rid)
    assert (record["state"], record["attempt"], record["decode_worker"]) == ("DECODING", "2",
                                                                             "d2")
    # The same attempt may write again.
    assert await store.update(rid, 2, {"tokens_sent": 5})
    assert (await store.get(rid))["tokens_sent"] == "5"
    # Unknown records are not created by an update.
    assert not await store.update(f"{rid}-nope", 1, {"state": State.DECODING})
    assert await store.get(f"{rid}-nope") is None


async def test_one_completions_retry_does_not_silence_the_other(store):
    """n = 2: completion 0 retried (attempt 2), then completion 1, still on
    attempt 1, moves on. Its write must land."""
    from engine.sampling_params import SamplingParams
    from gateway.request_record import RequestRecords
    from gateway.sequence import Sequence

    rid = f"n2-{random.randrange(1 << 30)}"
    records = RequestRecords(store)
    seqs = [Sequence(f"{rid}#{i}", i, [1, 2, 3], SamplingParams(), record_id=rid)
            for i in range(2)]
    await store.create(rid, {"n": 2})
    for s in seqs:
        await store.create(s.request_id, {"n": 1})
    seqs[0].attempt, seqs[1].attempt = 2, 1
    await records.state(seqs[0], State.DECODING)
    await records.state(seqs[1], State.DECODING)
    seqs[1].sent = [7, 8]
    await records.state(seqs[1], State.DECODING)  # progress of the slower completion
    assert (await store.get(f"{rid}#1"))["tokens_sent"] == "2"
    assert (await store.get(f"{rid}#0"))["attempt"] == "2"
    seqs[0].sent = [5]
    await records.close(rid, seqs, State.FINISHED)
    summary = await store.get(rid)
    assert (summary["state"], summary["tokens_sent"]) == ("FINISHED", "3")
    assert [(await store.get(s.request_id))["state"] for s in seqs] == ["FINISHED"] * 2


async def test_terminal_state_expires(store):
    import asyncio

    rid = f"ttl-{random.randrange(1 << 30)}"
    await store.create(rid, {})
    assert await store.update(rid, 1, {"state": State.DECODING})
    await asyncio.sleep(1.2)
    assert (await store.get(rid))["state"] == "DECODING"  # running records do not expire
    assert await store.update(rid, 1, {"state": State.FINISHED})
    assert (await store.get(rid))["state"] == "FINISHED"
    await asyncio.sleep(1.5)
    assert await store.get(rid) is None
