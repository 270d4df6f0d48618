"""Scale-down without lost streams, and the cluster seen from one scrape.

A worker that gets SIGTERM (Kubernetes removing a pod, ``docker compose
down``, an autoscaler shrinking a role) stops taking work, waits up to
``--grace`` seconds for its streams, then hands back the ones still open:
each ends with UNAVAILABLE and the gateway continues it on another decode
worker, so the client's text is exactly the uninterrupted text. Here the
workers run with ``--grace 0``, so the hand-back is certain, not a race with
the stream's end (test_workers.py checks that a stream within the grace
period finishes where it is).

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
    iter_sse,
    redis_db_fixture,
    redis_record,
    start_gateway,
    start_workers,
    stream_text,
    wait_blocks_free,
    wait_until,
)

DB = 6
NUM_BLOCKS = 64
LONG = {"prompt": "the quick brown fox", "max_tokens": 600, "temperature": 0,
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
    return start_workers(cluster, ["prefill", "decode", "decode"], NUM_BLOCKS,
                         "--state-url", url, "--grace", "0",
                         "--host", "0.0.0.0", "--advertise-host", POD_IP)


@pytest.fixture(scope="module")
def gateway(cluster, workers, url):
    return start_gateway(cluster, [], "--state-url", url)  # finds them in Redis


def test_workers_register_their_advertised_address(workers, url):
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        records = [json.loads(client.get(k)) for k in client.scan_iter("tandem:worker:*")]
    finally:
        client.close()
    assert sorted(r["address"] for r in records) == sorted(w.address for w in workers)
    assert all(w.address.startswith(f"{POD_IP}:") for w in workers)


def series(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of every sample of ``name`` in an exposition."""
    found = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        found[m.group(1) or ""] = float(m.group(2))
    return found


def scrape(gateway) -> str:
    return httpx.get(f"{gateway.url}/metrics", timeout=10).text


def test_gateway_metrics_show_its_queue_and_every_worker(gateway, workers):
    wait_until(lambda: len(series(scrape(gateway), "tandem:worker_up")) == len(workers), 10,
               "the gateway to poll every worker")
    text = scrape(gateway)
    assert series(text, "vllm:num_requests_waiting") == {"": 0.0}
    assert series(text, "vllm:num_requests_running") == {"": 0.0}
    up = series(text, "tandem:worker_up")
    for w in workers:
        labels = (f'{{address="{w.address}",worker="{w.worker_id}",'
                  f'worker_role="{w.proc.role}"}}')
        assert up[labels] == 1.0, up
        assert series(text, "tandem:worker_num_requests_running")[labels] == 0.0
        assert series(text, "tandem:worker_num_requests_waiting")[labels] == 0.0
        if w.proc.role == "decode":
            assert series(text, "tandem:worker_kv_cache_usage_perc")[labels] == 0.0


def test_sigterm_hands_open_streams_to_another_decode_worker(gateway, workers, url):
    with gateway.http() as http:
        reference = http.post("/v1/completions", json=LONG).json()["choices"][0]["text"]
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            events = iter_sse(r)
            received = [next(events) for _ in range(5)]
            rid = received[0]["id"]
            # The stream has its first tokens: it runs, it no longer waits.
            text = scrape(gateway)
            assert series(text, "vllm:num_requests_running") == {"": 1.0}
            assert series(text, "vllm:num_requests_waiting") == {"": 0.0}
            serving = next(w for w in workers
                           if w.worker_id == redis_record(url, rid)["decode_worker"])
            serving.proc.popen.send_signal(signal.SIGTERM)
            received += list(events)
    assert not any("error" in e for e in received if isinstance(e, dict)), received[-3:]
    assert received[-1] == "[DONE]"
    assert received[-2]["choices"][0]["finish_reason"] == "length"
    assert stream_text(received) == reference
    record = wait_until(lambda: (r := redis_record(url, rid)).get("state") == "FINISHED" and r,
                        10, "the request's final record")
    assert record["attempt"] == "2"
    assert record["decode_worker"] != serving.worker_id
    # The drained worker says what it handed back, and exits cleanly.
    assert serving.proc.popen.wait(15) == 0, serving.proc.output()[-3000:]
    assert "handing" in serving.proc.output()
    # Out of the registry, so out of the gateway's pool (a worker given by
    # flag would stay, with tandem:worker_up 0).
    wait_until(lambda: series(scrape(gateway), "tandem:worker_up").get(
        f'{{address="{serving.address}",worker="{serving.worker_id}",'
        f'worker_role="decode"}}', 0.0) == 0.0, 10, "the gateway to drop the worker")
    wait_blocks_free([w for w in workers if w is not serving])
