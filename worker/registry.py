"""Workers announce themselves in the state store with a heartbeat.

Key ``tandem:worker:{id}`` holds a JSON record and expires TTL seconds after
the last heartbeat, so a worker that stops heartbeating drops out of
rotation by itself.
"""

from __future__ import annotations

import asyncio
import json
import logging

logger = logging.getLogger("worker")

PREFIX = "tandem:worker:"
HEARTBEAT_S = 1.0
TTL_S = 3


class Registration:
    def __init__(self, url: str, worker) -> None:
        self.url = url
        self.worker = worker
        self._task: asyncio.Task | None = None
        self._redis = None

    async def start(self) -> None:
        import redis.asyncio as redis

        self._redis = redis.from_url(self.url)
        await self._beat()
        self._task = asyncio.ensure_future(self._loop())

    async def _beat(self) -> None:
        w = self.worker
        record = {"worker_id": w.worker_id, "role": w.role, "address": w.address}
        await self._redis.set(PREFIX + w.worker_id, json.dumps(record), ex=TTL_S)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._beat()
            except Exception as exc:  # the store being down must not kill the worker
                logger.warning("heartbeat failed: %s", exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._redis is not None:
            try:
                await self._redis.delete(PREFIX + self.worker.worker_id)
            finally:
                await self._redis.aclose()
