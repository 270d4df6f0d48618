"""A request's output stream in ``AsyncEngineLoop`` (engine/async_engine.py)."""

from __future__ import annotations

import asyncio
from typing import Any


class RequestStream:
    """A request's stream: its queue, and the number of the op that added it.

    A request id can be used again once its request has ended (a retry on
    the same worker, started while the old request's abort is queued). Each
    output is stamped with the number of the last op run before it was made;
    one stamped before the add is the old request's, still on its way to the
    event loop, and is dropped."""

    __slots__ = ("queue", "since")

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.since = -1  # set on the engine thread by the add

    def put(self, item: Any, stamp: int) -> None:
        if stamp >= self.since >= 0:
            self.queue.put_nowait(item)
