"""Soak and faults in one run, through the gateway's REST API on loopback:
1,000 short requests at concurrency 32, 30% of them abandoned by their
clients at a random point (streaming and not), one of the two decode workers
killed with SIGKILL a third of the way in, and Redis (registry and request
records) restarted empty two thirds of the way in.

Afterwards: every request that was not abandoned completed or got a clean
error (an OpenAI error object, as a status or as a stream's error event),
no worker holds a block or a request, the gateway's running gauge is back to
0, and every request record Redis has is in a final state. The figures go
to the test's output (``-s``) and docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx
import redis
from gateway_fixtures import (
    SERVED,
    RedisProcess,
    cluster_fixture,
    needs_redis_server,
    sigkill,
    start_gateway,
    start_workers,
    wait_blocks_free,
    wait_until,
)

from gateway.state import KEY

pytestmark = needs_redis_server

NUM_REQUESTS = 1000
CONCURRENCY = 32
ABANDON_SHARE = 0.3
KILL_AT = NUM_REQUESTS // 3  # requests started before a decode worker is killed
REDIS_RESTART_AT = 2 * NUM_REQUESTS // 3
SEED = 20261201
FINAL_STATES = {"FINISHED", "ABORTED", "FAILED"}

cluster = cluster_fixture()


def _is_error_object(body: object) -> bool:
    return (isinstance(body, dict) and set(body) == {"error"}
            and {"message", "type", "param", "code"} <= set(body["error"]))


async def _one(http: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    """One request; returns its outcome: completed, error, abandoned (or
    'unclean: ...' for anything a client should never see)."""
    abandon = rng.random() < ABANDON_SHARE
    stream = rng.random() < 0.5
    body = {"model": SERVED, "prompt": f"soak request {i}: " + "x" * rng.randint(1, 40),
            "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8]),
            "seed": i, "ignore_eos": True, "stream": stream}
    if abandon and not stream:
        try:
            await asyncio.wait_for(http.post("/v1/completions", json=body),
                                   rng.uniform(0.001, 0.2))
        except TimeoutError:
            pass
        return "abandoned"
    if not stream:
        r = await http.post("/v1/completions", json=body)
        if r.status_code == 200:
            finish = r.json()["choices"][0]["finish_reason"]
            return "completed" if finish == "length" else f"unclean: finish {finish}"
        return "error" if _is_error_object(r.json()) else f"unclean: {r.status_code} {r.text}"
    leave_after = rng.randint(0, 4) if abandon else None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return "error" if _is_error_object(r.json()) else f"unclean: {r.status_code}"
        events = []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if leave_after is not None and len(events) > leave_after:
                return "abandoned"  # leaving the block closes the connection
    if abandon:
        return "abandoned"  # it ended before the client got round to leaving
    if events[-1:] != ["[DONE]"]:
        return "unclean: stream ended without [DONE]"
    if _is_error_object(events[-2]):
        return "error"
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"]
                if c.get("finish_reason")]
    return "completed" if finishes == ["length"] else f"unclean: finishes {finishes}"


async def _soak(gateway_url: str, on_progress) -> Counter:
    rng = random.Random(SEED)
    plans = [random.Random(rng.random()) for _ in range(NUM_REQUESTS)]
    limit = asyncio.Semaphore(CONCURRENCY)
    started = 0

    async def run(i: int, http: httpx.AsyncClient) -> str:
        nonlocal started
        async with limit:
            started += 1
            await on_progress(started)
            try:
                return await _one(http, i, plans[i])
            except httpx.HTTPError as exc:
                return f"unclean: {type(exc).__name__} {exc}"

    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60, limits=limits) as http:
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(run(i, http) for i in range(NUM_REQUESTS))), 600)
    return Counter(outcomes)


def test_soak_with_a_worker_kill_and_a_redis_restart(cluster):
    with RedisProcess() as store:
        workers = start_workers(cluster, ["prefill", "decode", "decode"], 256,
                                "--state-url", store.url)
        # No static workers: the gateway finds them in Redis, so the restart
        # also tests that registration comes back.
        gateway = start_gateway(cluster, [], "--state-url", store.url,
                                "--max-active-requests", "64")
        with gateway.http() as http:
            wait_until(lambda: sum(w["healthy"] for w in http.get("/health").json()["workers"])
                       == 3, 15, "the gateway to discover the workers")
        victim = workers[1]

        async def faults(started: int) -> None:
            if started == KILL_AT:
                await asyncio.to_thread(sigkill, victim)
            elif started == REDIS_RESTART_AT:
                await asyncio.to_thread(store.stop)
                await asyncio.sleep(1.0)
                await asyncio.to_thread(store.start)

        outcomes = asyncio.run(_soak(gateway.url, faults))
        print(f"\nsoak outcomes: {dict(outcomes)}")

        unclean = {k: v for k, v in outcomes.items() if k.startswith("unclean")}
        assert not unclean, unclean
        # The faults really hit the run: the gateway served through the outage.
        assert "state store unreachable" in gateway.output()
        kept = NUM_REQUESTS - outcomes["abandoned"]
        # The faults may cost a few clean errors, not the service.
        assert outcomes["completed"] >= 0.95 * kept, outcomes

        survivors = [w for w in workers if w is not victim]
        wait_blocks_free(survivors)
        with gateway.http() as http:
            wait_until(lambda: "vllm:num_requests_running 0.0" in http.get("/metrics").text,
                       10, "the gateway's running gauge back to 0")
            # The store's own probe finds Redis back, with or without traffic.
            wait_until(lambda: "tandem:state_store_up 1.0" in http.get("/metrics").text,
                       15, "the gateway to find Redis again")
        # Records written since the restart (replayed or new) all reached an end.
        raw = redis.Redis(port=store.port, decode_responses=True)

        def states() -> Counter:
            return Counter(raw.hget(key, "state") for key in raw.scan_iter(KEY + "*"))

        try:
            wait_until(lambda: states() and set(states()) <= FINAL_STATES, 15,
                       "every request record in a final state")
        except AssertionError as exc:
            stuck = {key: raw.hgetall(key) for key in raw.scan_iter(KEY + "*")
                     if raw.hget(key, "state") not in FINAL_STATES}
            raise AssertionError(f"{exc}: {dict(states())}; {stuck}") from None
        gateway.proc.terminate()
        for w in survivors:
            w.proc.terminate()
