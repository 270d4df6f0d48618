"""Several streams read at once and merged into one, in the order items come.

Both fan-ins of the gateway use it: the ``n`` completions of one request (the
orchestrator) and the prompts of one batched completions call (the REST API).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")

_DONE = object()  # a source ran to its end


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class FanIn(Generic[T]):
    """Yields ``(source index, item)`` as the sources produce them; each
    source is read by a task of its own from construction on.

    The first source to fail ends the merged stream with its exception. The
    consumer must call ``aclose`` (or ``cancel``, then ``aclose`` later) when
    it stops reading: it cancels the sources still running and waits for
    them, so that their own cleanup (an ``except CancelledError``) has run.
    """

    def __init__(self, sources: list[AsyncIterator[T]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._running = len(sources)
        self._tasks = [asyncio.ensure_future(self._read(i, s)) for i, s in enumerate(sources)]

    async def _read(self, index: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                self._queue.put_nowait((index, item))
        except BaseException as exc:
            # NOTE: a CancelledError is queued too before it propagates: a
            # source cancelled from inside (not by ``cancel``) must not leave
            # the consumer waiting for an end that never comes.
            self._queue.put_nowait((index, _Failed(exc)))
            if not isinstance(exc, Exception):
                raise
        else:
            self._queue.put_nowait((index, _DONE))

    def __aiter__(self) -> FanIn[T]:
        return self

    async def __anext__(self) -> tuple[int, T]:
        while self._running:
            index, item = await self._queue.get()
            if item is _DONE:
                self._running -= 1
                continue
            if isinstance(item, _Failed):
                self._running = 0
                raise item.exc
            return index, item
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Stop every source still running (without waiting for it)."""
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        """Cancel the sources still running and wait until all have ended."""
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
