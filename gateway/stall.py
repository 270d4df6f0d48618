"""Telling a decode stream that waits from one that is stuck.

A stream on a decode worker is given up (and the orchestrator migrates it,
as it would a dead worker's) when

- its worker leaves rotation: it stopped answering the pool's polls or
  heartbeating, so nothing more is coming from it; or
- no chunk came for the stall window, and the worker's engine ran no model
  step in that window either: its engine loop is stuck, although its RPC
  threads still answer.

A worker that keeps stepping while one stream gets nothing is busy (the
request is queued or preempted behind others), not stuck: the stream waits.
The window is the configured floor (``--stall-timeout-s``) or
``STALL_STEPS`` of the worker's own recent step time, whichever is longer,
so a worker whose steps are slow (a big batch on a small CPU) is not
mistaken for a stuck one.
"""

from __future__ import annotations

import asyncio
import time

from gateway.router import WorkerView

STALL_STEPS = 20


def stall_window(worker: WorkerView, floor_s: float) -> float:
    """Seconds without a token (and without a step of the worker) after
    which a stream on ``worker`` counts as stuck."""
    return max(floor_s, STALL_STEPS * worker.step_s)


class StallWatch:
    """Watches one decode call; cancels it when the stream is stuck (see the
    module's docstring), with ``reason`` saying why. The consumer calls
    ``progress`` on each chunk and ``close`` when the call has ended."""

    def __init__(self, worker: WorkerView, floor_s: float, call) -> None:
        self.worker = worker
        self.floor_s = floor_s
        self.call = call
        self.reason: str | None = None
        self._last = time.monotonic()
        self._left = worker.left  # the event of the worker's current stay in rotation
        self._task = asyncio.ensure_future(self._watch())

    def progress(self) -> None:
        self._last = time.monotonic()

    def close(self) -> None:
        self._task.cancel()

    @property
    def window_s(self) -> float:
        return stall_window(self.worker, self.floor_s)

    async def _watch(self) -> None:
        while True:
            quiet_since = max(self._last, self.worker.stepped_at)
            wait_s = quiet_since + self.window_s - time.monotonic()
            if wait_s <= 0:
                self.reason = (f"no progress from {self.worker.address} for "
                               f"{self.window_s:.1f} s and no engine step there either")
                break
            try:
                await asyncio.wait_for(self._left.wait(), wait_s)
            except TimeoutError:
                continue
            self.reason = f"worker {self.worker.address} left rotation"
            break
        self.call.cancel()
