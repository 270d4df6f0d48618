"""Request state that survives a Redis outage.

Generation does not need Redis: the records are for operators and for
recovery, not for serving. So while Redis cannot be reached, writes go to
this process's memory and are replayed, in order, once it answers again;
requests go on meanwhile. A circuit breaker keeps requests from each
waiting out a timeout: after a failure Redis is not tried again for
``cooldown_s`` seconds (then one call probes it). A probe of its own also
runs every ``cooldown_s`` while Redis is down, so that the records are
replayed (and the gauge comes back) when it returns, traffic or not.

What is lost: a gateway that dies during an outage loses the writes it held
(each of those requests is counted as unrecorded), and the replay is capped
at ``max_pending`` records (beyond that, requests go unrecorded and are
counted). Fencing still holds for everything replayed: updates keep their
attempt numbers and Redis applies them with the same fenced script.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.state import MemoryStore, StateStore

logger = logging.getLogger("gateway")

# ("create", 0, fields) or ("update", attempt, fields), in the order they happened.
Op = tuple[str, int, dict[str, Any]]
# What a call on Redis gives when Redis is down (None is a real answer: no record).
DOWN = object()
PROBE_ID = "-probe-"  # a record no request has: reading it only asks whether Redis answers


class FallbackStore(StateStore):
    def __init__(self, primary: StateStore, finished_ttl_s: int = 3600, timeout_s: float = 1.0,
                 cooldown_s: float = 5.0, max_pending: int = 10_000,
                 on_change: Callable[[bool], None] | None = None) -> None:
        super().__init__(finished_ttl_s)
        self.primary = primary
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self.max_pending = max_pending
        self.on_change = on_change  # called with False when Redis is lost, True when back
        self.memory = MemoryStore(finished_ttl_s)  # what reads see of pending records
        self.pending: dict[str, list[Op]] = {}
        self.unrecorded = 0  # requests whose records were dropped
        self._retry_at = 0.0
        self._down = False
        self._replaying: asyncio.Task | None = None
        self._probing: asyncio.Task | None = None

    @property
    def available(self) -> bool:
        return not self._down

    async def create(self, request_id: str, fields: dict[str, Any]) -> None:
        if request_id not in self.pending and \
                await self._call(self.primary.create, request_id, fields) is not DOWN:
            return
        self.pending.pop(request_id, None)  # a new record replaces the old one's writes
        if self._hold(request_id, ("create", 0, fields)):
            await self.memory.create(request_id, fields)

    async def update(self, request_id: str, attempt: int, fields: dict[str, Any]) -> bool:
        if request_id not in self.pending:
            done = await self._call(self.primary.update, request_id, attempt, fields)
            if done is not DOWN:
                return bool(done)
        if not self._hold(request_id, ("update", attempt, fields)):
            return False
        if await self.memory.get(request_id) is None:  # a record Redis holds: mirror the change
            await self.memory.create(request_id, {})
        return await self.memory.update(request_id, attempt, fields)

    async def get(self, request_id: str) -> dict[str, str] | None:
        if request_id in self.pending:
            return await self.memory.get(request_id)
        record = await self._call(self.primary.get, request_id)
        return None if record is DOWN else record

    async def close(self) -> None:
        for task in (self._replaying, self._probing):
            if task is not None:
                task.cancel()
        if self.pending:
            logger.warning("closing with %d request records never written to the state store",
                           len(self.pending))
            self.unrecorded += len(self.pending)
        await self.primary.close()

    # ---- the breaker --------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``fn(*args)`` on Redis, or DOWN when Redis is down (or just failed)."""
        if self._down and time.monotonic() < self._retry_at:
            return DOWN
        try:
            result = await asyncio.wait_for(fn(*args), self.timeout_s)
        except (TimeoutError, OSError, ConnectionError) as exc:
            self._trip(exc)
            return DOWN
        except Exception as exc:  # redis-py's own ConnectionError/TimeoutError
            if type(exc).__module__.startswith("redis"):
                self._trip(exc)
                return DOWN
            raise
        if self._down:
            self._recovered()
        return result

    def _trip(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + self.cooldown_s
        if not self._down:
            self._down = True
            logger.error("state store unreachable (%s): serving on, recording in memory", exc)
            if self.on_change is not None:
                self.on_change(False)
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self._probe())

    async def _probe(self) -> None:
        """While Redis is down: try it every ``cooldown_s`` until it answers
        (``_call`` then notes the recovery and starts the replay)."""
        while self._down:
            await asyncio.sleep(max(0.0, self._retry_at - time.monotonic()))
            await self._call(self.primary.get, PROBE_ID)

    def _recovered(self) -> None:
        self._down = False
        logger.warning("state store reachable again: replaying %d request records",
                       len(self.pending))
        if self.on_change is not None:
            self.on_change(True)
        if self.pending and (self._replaying is None or self._replaying.done()):
            self._replaying = asyncio.ensure_future(self._replay())

    def _hold(self, request_id: str, op: Op) -> bool:
        ops = self.pending.get(request_id)
        if ops is None:
            if len(self.pending) >= self.max_pending:
                self.unrecorded += 1
                return False
            ops = self.pending[request_id] = []
        ops.append(op)
        return True

    async def _replay(self) -> None:
        """Write the held records, oldest first, until none is left or Redis
        fails again.

        NOTE: until none is left, not over a list taken at the start. While
        it runs, a failed call elsewhere (after a restart, each stale pooled
        connection fails once) holds more records, and the answer that
        follows closes the breaker while this replay still runs, so starts
        no other: records held then and missing from a list taken at the
        start stayed pending for good, and so did every later write of
        theirs (the soak test found records left QUEUED in Redis)."""
        while self.pending:
            request_id, ops = next(iter(self.pending.items()))
            try:
                for kind, attempt, fields in ops:  # also the writes added while it runs
                    if kind == "create":
                        await asyncio.wait_for(self.primary.create(request_id, fields),
                                               self.timeout_s)
                    else:
                        await asyncio.wait_for(self.primary.update(request_id, attempt, fields),
                                               self.timeout_s)
            except Exception as exc:  # down again: what is left waits for the next recovery
                self._trip(exc)
                return
            # Written: later writes go straight to Redis.
            if self.pending.get(request_id) is ops:
                del self.pending[request_id]
