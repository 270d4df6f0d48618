"""A prefill and a decode worker that both answer polls but cannot hand KV
to each other are kept apart (gateway/pair_health.py): requests still
succeed, through another prefill worker or by prefilling on the decode
worker, and nothing leaks.

The broken pair is real: a prefill worker whose ``--peer`` list names only
the second decode worker refuses every ticket for the first
(PERMISSION_DENIED), as one behind a firewall or a stale allow-list would.
Before, the first request routed to that pair failed outright."""

from __future__ import annotations

import time

import httpx
import pytest
from gateway_fixtures import cluster_fixture, start_gateway, start_workers, wait_blocks_free
from worker_fixtures import metric

from gateway.pair_health import PairHealth

# ---- the rule -------------------------------------------------------------------------------


def test_two_failures_in_a_row_part_a_pair_and_a_success_clears_it():
    pairs = PairHealth(cooldown_s=0.5, max_cooldown_s=1.2)
    pairs.failed("p", "d", "UNAVAILABLE")
    assert not pairs.apart("p", "d")  # one failure may be the request's bad luck
    pairs.succeeded("p", "d")
    pairs.failed("p", "d", "UNAVAILABLE")
    assert not pairs.apart("p", "d")  # not in a row
    pairs.failed("p", "d", "UNAVAILABLE")
    assert pairs.apart("p", "d") and not pairs.apart("p", "d2")
    assert pairs.apart_now() == [("p", "d")]
    pairs.failed("p", "d", "UNAVAILABLE")  # a request from before the parting: ignored
    time.sleep(0.6)
    assert not pairs.apart("p", "d") and pairs.apart_now() == []
    # On trial: the first failure parts it again, for twice as long (1 s)...
    pairs.failed("p", "d", "UNAVAILABLE")
    time.sleep(0.3)
    assert pairs.apart("p", "d")
    time.sleep(0.8)
    assert not pairs.apart("p", "d")
    # ...and then for 2 s, capped at 1.2.
    pairs.failed("p", "d", "UNAVAILABLE")
    assert pairs.apart("p", "d")
    time.sleep(1.3)
    assert not pairs.apart("p", "d")
    pairs.succeeded("p", "d")
    pairs.failed("p", "d", "UNAVAILABLE")
    assert not pairs.apart("p", "d")  # cleared: one failure parts nothing again


def test_a_worker_that_left_takes_its_pairs():
    pairs = PairHealth()
    for _ in range(2):
        pairs.failed("p", "d", "INTERNAL")
        pairs.failed("p2", "d", "INTERNAL")
    pairs.forget("p")
    assert pairs.apart_now() == [("p2", "d")]


# ---- end to end -------------------------------------------------------------------------------

cluster = cluster_fixture()
NUM_BLOCKS = 64
PROMPTS = [f"request {i}: the quick brown fox" for i in range(6)]


@pytest.fixture(scope="module")
def decodes(cluster):
    return start_workers(cluster, ["decode", "decode"], NUM_BLOCKS)


@pytest.fixture(scope="module")
def fenced_prefill(cluster, decodes):
    """A prefill worker that may push KV to the second decode worker only."""
    return start_workers(cluster, ["prefill"], NUM_BLOCKS, "--peer", decodes[1].address)[0]


@pytest.fixture(scope="module")
def reference(cluster):
    gw = start_gateway(cluster, start_workers(cluster, ["both"], NUM_BLOCKS))
    return complete(gw)


def complete(gw) -> list[str]:
    """Each prompt's greedy text, one request at a time, so that every one
    finds the first decode worker the emptiest, as a broken pair's decode
    worker is in production."""
    texts = []
    with gw.http() as http:
        for prompt in PROMPTS:
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
    return texts


def gateway_metrics(gw) -> str:
    return httpx.get(f"{gw.url}/metrics", timeout=10).text


def test_with_no_other_prefill_worker_the_decode_worker_prefills(cluster, decodes,
                                                                 fenced_prefill, reference):
    # The first decode worker first: ties go to the order given.
    gw = start_gateway(cluster, [fenced_prefill, *decodes])
    assert complete(gw) == reference
    text = gateway_metrics(gw)
    assert metric(text, "tandem:kv_handoff_pair_apart", prefill=fenced_prefill.address,
                  decode=decodes[0].address) == 1
    assert metric(text, "tandem:kv_handoff_pair_apart", prefill=fenced_prefill.address,
                  decode=decodes[1].address) is None
    # Two requests paid a failed handoff and went on elsewhere; the rest
    # were computed on the first decode worker, whatever the policy says.
    assert metric(text, "tandem:disagg_decisions_total", policy="always",
                  where="local") == len(PROMPTS) - 2
    wait_blocks_free([fenced_prefill, *decodes])


def test_another_prefill_worker_takes_the_broken_pairs_requests(cluster, decodes,
                                                                fenced_prefill, reference):
    other = start_workers(cluster, ["prefill"], NUM_BLOCKS)[0]
    gw = start_gateway(cluster, [fenced_prefill, other, *decodes])
    assert complete(gw) == reference
    text = gateway_metrics(gw)
    assert metric(text, "tandem:disagg_decisions_total", policy="always", where="local") is None
    wait_blocks_free([fenced_prefill, other, *decodes])
