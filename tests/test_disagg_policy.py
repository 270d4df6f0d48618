"""--disagg-policy: where each prompt is computed. The auto rule on worker
views, and end to end: ``never`` computes every prompt on the decode
worker (no KV moves), ``always`` on the prefill worker; both give the
colocated greedy text and leak no block."""

from __future__ import annotations

import httpx
import pytest
from gateway_fixtures import cluster_fixture, start_gateway, start_workers, wait_blocks_free
from worker_fixtures import metric, scrape

from gateway.disagg_policy import DisaggPolicy, PrefixTracker
from gateway.router import WorkerView

KV_PER_TOKEN = 16 << 10


def view(address: str, running: int = 0, waiting: int = 0) -> WorkerView:
    return WorkerView(address, block_size=16, num_running=running, num_waiting=waiting,
                      healthy=True, kv_bytes_per_token=KV_PER_TOKEN)


def test_short_prompts_stay_local():
    p = DisaggPolicy("auto", min_remote_tokens=256)
    d = p.decide(list(range(200)), view("d", running=8), view("p"), KV_PER_TOKEN)
    assert not d.remote and d.inputs["uncached_local"] == 200


def test_long_uncached_prompt_goes_remote_when_the_decode_worker_is_busy():
    p = DisaggPolicy("auto", min_remote_tokens=256)
    d = p.decide(list(range(2000)), view("d", running=6), view("p"), KV_PER_TOKEN)
    assert d.remote and d.inputs["cost_remote_s"] < d.inputs["cost_local_s"]
    # ...but not when the prefill worker's queue is longer still.
    d = p.decide(list(range(2000)), view("d", running=6), view("p", waiting=20), KV_PER_TOKEN)
    assert not d.remote


def test_an_idle_decode_worker_computes_a_long_prompt_itself():
    """Nothing runs there to stall, and the handoff only adds the transfer."""
    d = DisaggPolicy("auto").decide(list(range(2000)), view("d"), view("p"), KV_PER_TOKEN)
    assert not d.remote and d.reason == "local is cheaper"


def test_a_prefix_cached_on_the_decode_worker_keeps_a_long_prompt_local():
    p = DisaggPolicy("auto", min_remote_tokens=256)
    prompt = list(range(2000))
    p.routed("d", prompt[:1900], 16)  # an earlier request computed most of it there
    d = p.decide(prompt, view("d", running=6), view("p"), KV_PER_TOKEN)
    assert not d.remote and d.inputs["uncached_local"] == 2000 - 1888


def test_measured_bandwidth_and_compute_speed_enter_the_costs():
    p = DisaggPolicy("auto", min_remote_tokens=0)
    for _ in range(30):  # a slow pair: 1 MiB/s
        p.observe_prefill("p", "d", uncached_tokens=100, call_seconds=1.1, kv_bytes=1 << 20,
                          transfer_seconds=1.0)
    assert p.bandwidth[("p", "d")] == pytest.approx(1 << 20, rel=1e-3)
    assert p.s_per_token == pytest.approx(1e-3, rel=1e-2)
    d = p.decide(list(range(2000)), view("d", running=6), view("p"), KV_PER_TOKEN)
    assert not d.remote  # 31 MiB over 1 MiB/s costs more than computing locally


def test_always_and_never_ignore_the_costs():
    args = (list(range(5)), view("d"), view("p"), KV_PER_TOKEN)
    assert DisaggPolicy("always").decide(*args).remote
    assert not DisaggPolicy("never").decide(*args).remote
    with pytest.raises(ValueError, match="disagg policy"):
        DisaggPolicy("sometimes")


def test_prefix_tracker_forgets_the_oldest():
    t = PrefixTracker(capacity=4)
    t.record("w", list(range(64)), 16)  # 4 blocks
    assert t.hit_tokens("w", list(range(80)), 16) == 64
    t.record("w", [9] * 32, 16)  # 2 more: the first two blocks' hashes go
    assert t.hit_tokens("w", list(range(80)), 16) == 0


# ---- end to end ---------------------------------------------------------------------------

cluster = cluster_fixture()
NUM_BLOCKS = 64
PROMPTS = ["the quick brown fox", "b" * 120]


@pytest.fixture(scope="module")
def workers(cluster):
    return start_workers(cluster, ["prefill", "decode"], NUM_BLOCKS, metrics=True)


@pytest.fixture(scope="module")
def colocated(cluster):
    return start_gateway(cluster, start_workers(cluster, ["both"], NUM_BLOCKS))


def texts(gw) -> list[str]:
    with gw.http() as http:
        out = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True})
               for p in PROMPTS]
    assert [r.status_code for r in out] == [200] * len(out), out[0].text
    return [r.json()["choices"][0]["text"] for r in out]


def sent_bytes(prefill) -> float:
    return metric(scrape(prefill.metrics_port), "tandem:kv_transfer_bytes_total",
                  transport="grpc", direction="send") or 0.0


@pytest.mark.parametrize("policy", ["never", "always"])
def test_policy_end_to_end(cluster, workers, colocated, policy):
    gw = start_gateway(cluster, workers, "--disagg-policy", policy)
    before = sent_bytes(workers[0])
    assert texts(gw) == texts(colocated)
    moved = sent_bytes(workers[0]) - before
    assert (moved > 0) == (policy == "always")
    decisions = httpx.get(f"{gw.url}/metrics", timeout=10).text
    where = "remote" if policy == "always" else "local"
    assert metric(decisions, "tandem:disagg_decisions_total", policy=policy,
                  where=where) == len(PROMPTS)
    wait_blocks_free(workers)
