"""Scale-down without lost streams, and the cluster seen from one scrape.

A worker that gets SIGTERM (Kubernetes removing a pod, ``docker compose
stop``, an autoscaler shrinking a role) stops taking work and lets its
streams run for up to ``--grace`` seconds, then hands back the ones still
open: each ends with UNAVAILABLE and the gateway continues it on another
decode worker, so the client's text is exactly the uninterrupted text.

Three decode workers make each case certain rather than a race with the
stream's end: "patient" (``--grace 30``, the most blocks, so the gateway
picks it first) must finish its stream itself; "hasty" (``--grace 0``, the
next most blocks) must hand its stream to "spare".

The workers run as in a Kubernetes pod: bound to every interface,
advertising this machine's routable address (their pod IP there) in Redis,
and the gateway knows them only from Redis, so every call and every KV push
goes to the advertised address.

The gateway's /metrics carries its own queue (``vllm:num_requests_waiting``,
``vllm:num_requests_running``) and every worker's load from its polls
(``tandem:worker_*``, labelled by worker).
"""

from __future__ import annotations

import json
import re
import signal
import socket

import httpx
import pytest
from gateway_fixtures import (
    cluster_fixture,
    info,
    iter_sse,
    redis_db_fixture,
    redis_record,
    start_gateway,
    stream_text,
    tiny_model,
    wait_blocks_free,
    wait_until,
)
from worker_fixtures import start_worker

DB = 6
# NOTE: as long as the workers' caches allow (the spare worker's 60 blocks
# hold 960 tokens): the tiny model streams 900 tokens in about 0.75 s, and
# the drain must outlast the test's first poll of the draining worker.
LONG = {"prompt": "the quick brown fox", "max_tokens": 900, "temperature": 0,
        "ignore_eos": True}

url = redis_db_fixture(DB)
cluster = cluster_fixture()


def routable_ip() -> str:
    """This machine's address on its default route (no packet is sent), or
    loopback where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


POD_IP = routable_ip()


@pytest.fixture(scope="module")
def workers(cluster, url):
    """name -> worker: prefill, patient, hasty, spare."""

    def start(role: str, blocks: int, grace: str):
        return start_worker(cluster, role, tiny_model(), blocks, "--state-url", url,
                            "--grace", grace, "--host", "0.0.0.0", "--advertise-host", POD_IP)

    return {"prefill": start("prefill", 64, "0"), "patient": start("decode", 96, "30"),
            "hasty": start("decode", 64, "0"), "spare": start("decode", 60, "0")}


@pytest.fixture(scope="module")
def gateway(cluster, workers, url):
    return start_gateway(cluster, [], "--state-url", url)  # finds them in Redis


def series(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of every sample of ``name`` in an exposition."""
    found = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        found[m.group(1) or ""] = float(m.group(2))
    return found


def scrape(gateway) -> str:
    return httpx.get(f"{gateway.url}/metrics", timeout=10).text


def labels_of(w) -> str:
    return f'{{address="{w.address}",worker="{w.worker_id}",worker_role="{w.proc.role}"}}'


def test_workers_register_their_advertised_address(workers, url):
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        records = [json.loads(client.get(k)) for k in client.scan_iter("tandem:worker:*")]
    finally:
        client.close()
    assert sorted(r["address"] for r in records) == sorted(w.address for w in workers.values())
    assert all(w.address.startswith(f"{POD_IP}:") for w in workers.values())


def test_gateway_metrics_show_its_queue_and_every_worker(gateway, workers):
    wait_until(lambda: len(series(scrape(gateway), "tandem:worker_up")) == len(workers), 10,
               "the gateway to poll every worker")
    text = scrape(gateway)
    assert series(text, "vllm:num_requests_waiting") == {"": 0.0}
    assert series(text, "vllm:num_requests_running") == {"": 0.0}
    for w in workers.values():
        assert series(text, "tandem:worker_up")[labels_of(w)] == 1.0
        assert series(text, "tandem:worker_num_requests_running")[labels_of(w)] == 0.0
        assert series(text, "tandem:worker_num_requests_waiting")[labels_of(w)] == 0.0
        if w.proc.role == "decode":
            assert series(text, "tandem:worker_kv_cache_usage_perc")[labels_of(w)] == 0.0


def stream_and_sigterm(gateway, workers, url, expected: str,
                       while_draining=lambda: None) -> tuple[list, str]:
    """Stream LONG; after its first chunks, SIGTERM the decode worker
    serving it (which must be ``expected``) and call ``while_draining``;
    return the events and the request id."""
    # The gateway picks the decode worker with the most free blocks by its
    # last poll: wait until that poll has seen the last request's go.
    wait_until(lambda: set(series(scrape(gateway), "tandem:worker_kv_cache_usage_perc")
                           .values()) == {0.0}, 10, "every decode worker's blocks free")
    with gateway.http() as http, http.stream("POST", "/v1/completions",
                                             json={**LONG, "stream": True}) as r:
        events = iter_sse(r)
        received = [next(events)]
        rid = received[0]["id"]
        assert redis_record(url, rid)["decode_worker"] == workers[expected].worker_id
        # NOTE: at once: the tiny model streams LONG in under a second, and
        # the test is about a stream still open when the signal comes.
        workers[expected].proc.popen.send_signal(signal.SIGTERM)
        while_draining()
        received += list(events)
    assert not any("error" in e for e in received if isinstance(e, dict)), received[-3:]
    assert received[-1] == "[DONE]"
    assert received[-2]["choices"][0]["finish_reason"] == "length"
    return received, rid


def redis_record_exists(url: str, key: str) -> bool:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return bool(client.exists(key))
    finally:
        client.close()


def final_record(url: str, rid: str) -> dict:
    return wait_until(lambda: (r := redis_record(url, rid)).get("state") == "FINISHED" and r,
                      10, "the request's final record")


def stopped_cleanly(gateway, w) -> None:
    assert w.proc.popen.wait(40) == 0, w.proc.output()[-3000:]
    # Out of the registry, so out of the gateway's pool (a worker given by
    # flag would stay, with tandem:worker_up 0).
    wait_until(lambda: series(scrape(gateway), "tandem:worker_up").get(labels_of(w), 0.0)
               == 0.0, 10, "the gateway to drop the worker")


@pytest.fixture(scope="module")
def reference(gateway):
    with gateway.http() as http:
        return http.post("/v1/completions", json=LONG).json()["choices"][0]["text"]


def test_sigterm_lets_a_stream_finish_within_the_grace_period(gateway, workers, url,
                                                              reference):
    patient = workers["patient"]

    def still_registered() -> None:
        # NOTE: a registration gone missing makes the gateway move the
        # worker's streams after 3 s: the worker stays registered, saying
        # "draining" in its Info, until its drain is over.
        wait_until(lambda: info(patient.address).draining, 10, "the worker to drain")
        assert redis_record_exists(url, f"tandem:worker:{patient.worker_id}")

    received, rid = stream_and_sigterm(gateway, workers, url, expected="patient",
                                       while_draining=still_registered)
    assert stream_text(received) == reference
    record = final_record(url, rid)
    assert record["attempt"] == "1" and record["decode_worker"] == patient.worker_id
    stopped_cleanly(gateway, patient)
    assert "handing" not in patient.proc.output()


def test_sigterm_hands_open_streams_to_another_decode_worker(gateway, workers, url, reference):
    received, rid = stream_and_sigterm(gateway, workers, url, expected="hasty")
    assert stream_text(received) == reference
    record = final_record(url, rid)
    assert record["attempt"] == "2" and record["decode_worker"] == workers["spare"].worker_id
    hasty = workers["hasty"]
    stopped_cleanly(gateway, hasty)
    assert "handing" in hasty.proc.output()  # what it handed back, in its log
    wait_blocks_free([workers["prefill"], workers["spare"]])
