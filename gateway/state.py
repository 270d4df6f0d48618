"""Request state: Redis when configured, an in-process store otherwise.

One record per request::

    tandem:req:{id} -> hash {state, attempt, prompt_tokens, params (JSON, with
                             seed), tokens_sent, prefill_worker, decode_worker,
                             created, updated, lease_expiry_ms}

and with ``n > 1`` one more per completion, ``tandem:req:{id}-{i}`` (with
``parent`` and ``index``), fenced on that completion's own attempts; the
request's record then stays at attempt 0 and sums ``tokens_sent`` at the end.

Writes carry the attempt number and are fenced: a write from an attempt
older than the stored one is dropped, so a worker presumed dead cannot
overwrite what its replacement wrote. Finished records expire after a TTL.
Redis is written on state changes only, never per token.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from typing import Any


class State(enum.StrEnum):
    QUEUED = "QUEUED"
    PREFILLING = "PREFILLING"
    DECODING = "DECODING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    ABORTED = "ABORTED"

    @property
    def terminal(self) -> bool:
        return self in (State.FINISHED, State.FAILED, State.ABORTED)


KEY = "tandem:req:"


class StateStore(ABC):
    def __init__(self, finished_ttl_s: int = 3600) -> None:
        self.finished_ttl_s = finished_ttl_s

    @abstractmethod
    async def create(self, request_id: str, fields: dict[str, Any]) -> None:
        """A new record in state QUEUED, attempt 0."""

    @abstractmethod
    async def update(self, request_id: str, attempt: int, fields: dict[str, Any]) -> bool:
        """Write ``fields`` unless a newer attempt has written already.
        Moving to a terminal state starts the record's expiry."""

    @abstractmethod
    async def get(self, request_id: str) -> dict[str, str] | None: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


def _encode(fields: dict[str, Any]) -> dict[str, str]:
    out = {k: (v.value if isinstance(v, State) else str(v)) for k, v in fields.items()}
    out["updated"] = f"{time.time():.3f}"
    return out


class MemoryStore(StateStore):
    """The embedded default: the same interface, in this process."""

    def __init__(self, finished_ttl_s: int = 3600) -> None:
        super().__init__(finished_ttl_s)
        self._records: dict[str, tuple[dict[str, str], float | None]] = {}

    async def create(self, request_id, fields):
        self._expire()
        record = {"state": State.QUEUED.value, "attempt": "0", "created": f"{time.time():.3f}"}
        record.update(_encode(fields))
        self._records[request_id] = (record, None)

    async def update(self, request_id, attempt, fields):
        entry = self._records.get(request_id)
        if entry is None or int(entry[0]["attempt"]) > attempt:
            return False
        record = entry[0]
        record.update(_encode(fields))
        record["attempt"] = str(attempt)
        expiry = None
        if State(record["state"]).terminal:
            expiry = time.monotonic() + self.finished_ttl_s
        self._records[request_id] = (record, expiry)
        return True

    async def get(self, request_id):
        self._expire()
        entry = self._records.get(request_id)
        return dict(entry[0]) if entry else None

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (_, exp) in self._records.items() if exp is not None and exp <= now]:
            del self._records[rid]


# Fenced update: apply only if the stored attempt is not newer; set a TTL on
# terminal states. KEYS[1] = record; ARGV = attempt, ttl, then field/value pairs.
_FENCED_UPDATE = """
local current = redis.call('HGET', KEYS[1], 'attempt')
if not current then return 0 end
if tonumber(current) > tonumber(ARGV[1]) then return 0 end
local args = {'attempt', ARGV[1]}
for i = 3, #ARGV do args[#args + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(args))
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'FINISHED' or state == 'FAILED' or state == 'ABORTED' then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 1
"""


class RedisStore(StateStore):
    def __init__(self, url: str, finished_ttl_s: int = 3600) -> None:
        import redis.asyncio as redis

        super().__init__(finished_ttl_s)
        # Short timeouts: a store that does not answer is down (fallback_store.py).
        self.redis = redis.from_url(url, decode_responses=True, socket_timeout=1.0,
                                    socket_connect_timeout=1.0)
        self._update = self.redis.register_script(_FENCED_UPDATE)

    async def create(self, request_id, fields):
        record = {"state": State.QUEUED.value, "attempt": "0", "created": f"{time.time():.3f}"}
        record.update(_encode(fields))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(KEY + request_id)
            pipe.hset(KEY + request_id, mapping=record)
            # A record nobody finishes (a crashed gateway) still goes away.
            pipe.expire(KEY + request_id, max(self.finished_ttl_s, 24 * 3600))
            await pipe.execute()

    async def update(self, request_id, attempt, fields):
        flat: list[str] = []
        for k, v in _encode(fields).items():
            flat += [k, v]
        done = await self._update(keys=[KEY + request_id],
                                  args=[attempt, self.finished_ttl_s, *flat])
        return bool(done)

    async def get(self, request_id):
        record = await self.redis.hgetall(KEY + request_id)
        return record or None

    async def close(self) -> None:
        await self.redis.aclose()


def make_store(url: str | None, finished_ttl_s: int = 3600) -> StateStore:
    if url:
        return RedisStore(url, finished_ttl_s)
    return MemoryStore(finished_ttl_s)
