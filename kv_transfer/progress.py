"""How far a prompt's KV has been computed, for senders that stream blocks
while the prefill is still running (chunked prefill)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch

# read(lo, hi): blocks [lo, hi) of every layer, or None if they are no longer
# computed (the request was preempted and is recomputing).
BlockReader = Callable[[int, int], Awaitable[torch.Tensor | None]]


class PrefillProgress:
    """``ready`` counts the request's leading blocks that hold final KV. It
    grows after each prefill step (full blocks only; the last, partial block
    when the prompt is done) and may fall back if the request is preempted."""

    def __init__(self, total_blocks: int, read: BlockReader) -> None:
        self.total = total_blocks
        self.read = read
        self.ready = 0
        self._changed = asyncio.Event()

    def update(self, ready_blocks: int) -> None:
        self.ready = min(ready_blocks, self.total)
        self._changed.set()

    def complete(self) -> None:
        self.update(self.total)

    async def wait_beyond(self, sent: int) -> int:
        """Wait until more than ``sent`` blocks are ready; return how many."""
        while self.ready <= sent:
            self._changed.clear()
            await self._changed.wait()
        return self.ready
