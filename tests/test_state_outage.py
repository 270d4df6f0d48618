"""A Redis outage does not stop generation: the gateway records in memory,
answers every request meanwhile, and writes the records once Redis is back.
Runs its own redis-server (the suite's shared one must stay up)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis
from gateway_fixtures import (
    SERVED,
    RedisProcess,
    cluster_fixture,
    needs_redis_server,
    start_gateway,
    start_workers,
)

from gateway.fallback_store import FallbackStore
from gateway.state import KEY, MemoryStore, RedisStore, State

pytestmark = needs_redis_server

cluster = cluster_fixture()


@pytest.fixture
def redis_process():
    with RedisProcess() as r:
        yield r


def test_requests_go_on_while_redis_is_down_and_are_recorded_after(cluster, redis_process):
    workers = start_workers(cluster, ["prefill", "decode"], 64)
    gateway = start_gateway(cluster, workers, "--state-url", redis_process.url)
    client_redis = redis.Redis(port=redis_process.port, decode_responses=True)
    try:
        with gateway.client() as client:
            def complete() -> tuple[str, float]:
                start = time.monotonic()
                out = client.completions.create(model=SERVED, prompt="the quick brown fox",
                                                max_tokens=3, temperature=0)
                assert out.choices[0].finish_reason == "length"
                return out.id, time.monotonic() - start

            before, _ = complete()
            assert client_redis.hget(KEY + before, "state") == "FINISHED"

            redis_process.stop()
            during = [complete() for _ in range(4)]
            # The breaker: after the first failure nobody waits for a Redis timeout.
            assert all(seconds < 10 for _, seconds in during[1:]), during
            with gateway.http() as http:
                metrics = http.get("/metrics").text
            assert "tandem:state_store_up 0.0" in metrics

            redis_process.start()  # empty: nothing of the outage is there yet
            deadline = time.monotonic() + 30
            ids = [rid for rid, _ in during]
            while time.monotonic() < deadline:
                complete()  # a call after the cooldown finds Redis and starts the replay
                states = [client_redis.hget(KEY + rid, "state") for rid in ids]
                if states == ["FINISHED"] * len(ids):
                    break
                time.sleep(1)
            assert [client_redis.hget(KEY + rid, "state") for rid in ids] == \
                ["FINISHED"] * len(ids)
            with gateway.http() as http:
                assert "tandem:state_store_up 1.0" in http.get("/metrics").text
    finally:
        gateway.proc.terminate()
        for w in workers:
            w.proc.terminate()


def test_replayed_updates_keep_their_fencing(redis_process):
    async def run() -> None:
        store = FallbackStore(RedisStore(redis_process.url), timeout_s=0.3, cooldown_s=0.0)
        await store.create("r", {"tokens_sent": 0})
        assert await store.get("never-created") is None
        redis_process.proc.send_signal(signal.SIGSTOP)  # frozen: every call times out
        try:
            await store.update("r", 2, {"state": State.DECODING})
            await store.update("r", 1, {"state": State.FAILED})  # a stale attempt
            assert not store.available and (await store.get("r"))["state"] == "DECODING"
            await store.create("new", {"tokens_sent": 0})
        finally:
            redis_process.proc.send_signal(signal.SIGCONT)
        # The first answer closes the breaker and replays; on a loaded machine
        # the first call after the thaw may still time out.
        deadline = time.monotonic() + 10
        while store._replaying is None and time.monotonic() < deadline:
            await store.get("other")
        await store._replaying
        assert store.pending == {} and store.available
        raw = redis.Redis(port=redis_process.port, decode_responses=True)
        # Replayed in order through the fenced script: the stale attempt is dropped.
        assert raw.hget(KEY + "r", "state") == "DECODING"
        assert raw.hget(KEY + "r", "attempt") == "2"
        assert raw.hget(KEY + "new", "state") == "QUEUED"
        await store.close()

    asyncio.run(run())


def test_pending_records_are_bounded():
    async def run() -> None:
        class Down(MemoryStore):
            async def create(self, *a):
                raise ConnectionError("down")

        store = FallbackStore(Down(), max_pending=2)
        for i in range(5):
            await store.create(f"r{i}", {})
        assert len(store.pending) == 2 and store.unrecorded == 3

    asyncio.run(run())


def test_records_held_while_a_replay_runs_are_replayed_too():
    """After a restart, Redis answers between failures (each stale pooled
    connection fails once): a record held while a replay runs, and after the
    breaker closed again, must still reach Redis with every later write."""

    class Gated(MemoryStore):
        """Down when ``down``; its writes wait at ``gate`` while it is set."""

        def __init__(self) -> None:
            super().__init__()
            self.down = False
            self.gate: asyncio.Event | None = None
            self.waiting = 0  # writes waiting at the gate

        async def _reach(self, write: bool) -> None:
            if self.down:
                raise ConnectionError("down")
            if write and self.gate is not None and not self.gate.is_set():
                self.waiting += 1
                await self.gate.wait()

        async def create(self, *a):
            await self._reach(True)
            await super().create(*a)

        async def update(self, *a):
            await self._reach(True)
            return await super().update(*a)

        async def get(self, *a):
            await self._reach(False)
            return await super().get(*a)

    async def run() -> None:
        primary = Gated()
        store = FallbackStore(primary, timeout_s=10.0, cooldown_s=0.0)
        primary.down = True
        await store.create("a", {"tokens_sent": 0})  # held
        primary.down, primary.gate = False, asyncio.Event()
        await store.get("x")  # Redis answers: the replay starts and waits at the gate
        replay = store._replaying
        while not primary.waiting:
            assert replay is not None and not replay.done()
            await asyncio.sleep(0)

        primary.down = True
        await store.create("b", {"tokens_sent": 0})  # fails: held while the replay runs
        primary.down = False
        await store.get("x")  # answers again: the breaker closes, the replay still runs
        assert store.available and store._replaying is replay
        await store.update("b", 1, {"state": State.FINISHED})  # "b" is held: queued behind

        primary.gate.set()
        await replay
        assert store.pending == {}
        assert (await primary.get("a"))["state"] == "QUEUED"
        assert (await primary.get("b"))["state"] == "FINISHED"
        await store.close()

    asyncio.run(run())
