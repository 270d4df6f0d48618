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


class PromptDone:
    """An engine ``LayerKVSink`` that resolves ``blocks`` with the prompt's
    block ids (and, on a GPU, a CUDA event to wait for) right after the
    forward pass that completes the prompt: inside that step, before its
    sampling and outputs, so a one-batch transfer starts that much earlier
    than the request's final output (and without a call to the engine
    thread, which may be busy with the next step by then)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, device: torch.device,
                 num_blocks: int) -> None:
        """``num_blocks``: the prompt's (a chunked prompt's table is shorter
        until its last chunk)."""
        self.loop = loop
        self.cuda = device.type == "cuda"
        self.num_blocks = num_blocks
        self.blocks: asyncio.Future = loop.create_future()
        self._ids: list[int] = []
        self._complete = False

    def begin_step(self, block_ids: list[int], num_final: int) -> None:
        self._ids, self._complete = block_ids, num_final == self.num_blocks

    def layer_done(self, layer: int) -> None:
        pass

    def end_step(self) -> None:
        if not self._complete:
            return
        event = None
        if self.cuda:  # the forward's kernels are queued, not done: the write waits for them
            event = torch.cuda.Event()
            event.record()
        self.loop.call_soon_threadsafe(resolve_once, self.blocks, (list(self._ids), event))

    def rewind(self) -> None:
        pass


def resolve_once(future: asyncio.Future, value) -> None:
    """Resolve ``future`` unless it is already (on its event loop)."""
    if not future.done():
        future.set_result(value)
