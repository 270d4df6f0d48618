"""An asyncio front for LLMEngine.

The engine is single-threaded: every mutation (add, abort, step, and the
workers' reservation calls) runs on one engine thread, between steps, so the
event loop never blocks on the model and the engine never sees two callers
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.core_lease import CoreLease
from engine.errors import EngineUnusable
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("engine")
T = TypeVar("T")


class AsyncEngineLoop:
    """Runs an LLMEngine on a thread of its own, stepping while there is
    work, and hands its outputs to asyncio streams. Workers hold one; the
    public ``tandem.AsyncEngine`` is one built from vLLM-style arguments."""

    def __init__(self, engine: LLMEngine, cores: CoreLease | None = None) -> None:
        """``cores``: cores shared with other workers on this host, held
        around each step (engine/core_lease.py); None: the process's own."""
        self.engine = engine
        self.cores = cores
        self._ops: list[tuple[Callable[[LLMEngine], Any], asyncio.Future, bool]] = []
        self._ops_lock = threading.Lock()
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._task: asyncio.Task | None = None
        self._closed = False
        # Called on the event loop after each step with the step's outputs.
        self.step_hooks: list[Callable[[list[RequestOutput]], None]] = []
        # Set once the engine cannot run another step (EngineUnusable: a
        # step or a KV copy broke the tensor-parallel group): a server
        # watching it should drain and exit.
        self.unusable = asyncio.Event()
        # The loop to wake when another thread breaks the engine (an
        # asyncio.Event set from outside its loop wakes no waiter): the one
        # this is built in, if any, else the first that runs it.
        try:
            self._event_loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._event_loop = None
        engine.on_unusable(self._mark_unusable)

    def _mark_unusable(self) -> None:
        """Called from whichever thread broke the engine."""
        if self._event_loop is None:
            self.unusable.set()
        else:
            self._event_loop.call_soon_threadsafe(self.unusable.set)

    # ---- public API ------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Yield incremental outputs until the request finishes. Leaving the
        loop early (or cancelling) aborts the request."""
        params = params or SamplingParams()
        # NOTE: not id(object()): a freed temporary's id is reused at once, so
        # two concurrent generates would get the same id.
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        # Tokenized here, on the caller's side; add_request validates.
        prompt_text, token_ids = self.engine.tokenize(prompt)

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, token_ids, params, prompt_text=prompt_text)

        # NOTE: aclosing, so that closing this generator closes the stream at
        # once (its finally aborts the request) instead of whenever the
        # garbage collector finalizes it.
        async with contextlib.aclosing(self.stream(request_id, add)) as stream:
            async for out in stream:
                yield out

    async def stream(
        self, request_id: str, add: Callable[[LLMEngine], list[RequestOutput] | None]
    ) -> AsyncIterator[RequestOutput]:
        """Run ``add(engine)`` on the engine thread to start a request, then
        yield its outputs until it finishes (``add`` may return outputs it
        produced itself). Leaving early aborts the request."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        # Registered before the add: the add's own step may already produce output.
        self._streams[request_id] = queue
        try:
            await self.run(add, emits_outputs=True)
        except Exception:
            # The add itself failed (e.g. the id is in use): nothing landed, and
            # an abort would hit the other request that holds this id.
            self._streams.pop(request_id, None)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            if not self._closed:
                # Cancelled mid-add: the add may still land. The abort is queued
                # now, right behind the add, not after whatever comes next.
                self._submit(lambda engine: engine.abort_request(request_id), True)
            raise
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._closed:
                await asyncio.shield(self.abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; when this returns its blocks are free."""
        outs = await self.run(lambda engine: engine.abort_request(request_id))
        self._dispatch(outs)

    async def run(self, fn: Callable[[LLMEngine], T], emits_outputs: bool = False) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps. With
        ``emits_outputs``, ``fn`` returns RequestOutputs (or None) that are
        dispatched before the outputs of the step that follows it."""
        return await self._submit(fn, emits_outputs)

    def _submit(self, fn: Callable[[LLMEngine], T], emits_outputs: bool) -> asyncio.Future:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        self._ensure_loop()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._ops_lock:
            self._ops.append((fn, future, emits_outputs))
        self._wake.set()
        return future

    async def shutdown(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._thread.shutdown(wait=True)
        if self.cores is not None:
            self.cores.close()
        self.engine.shutdown()

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    # ---- the loop ------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._ops_lock:
                ops, self._ops = self._ops, []
            if not ops and not self.engine.has_unfinished_requests():
                self._wake.clear()
                await self._sleep()
                continue
            # NOTE: the ops' results come back before the step (``_tick``), so
            # also when the step after them fails: their callers (an add, an
            # abort) would wait forever otherwise.
            outputs, failed = await loop.run_in_executor(self._thread, self._tick, ops, loop)
            if failed is not None:  # the model failed: fail what was running, keep serving
                logger.error("engine step failed", exc_info=failed)
                aborted = await loop.run_in_executor(self._thread,
                                                     self.engine.recover_from_failed_step)
                for request_id in aborted:
                    queue = self._streams.get(request_id)
                    if queue is not None:
                        queue.put_nowait(RuntimeError(f"engine step failed: {failed}"))
                if isinstance(failed, EngineUnusable):
                    self.unusable.set()  # also done by the watcher; harmless twice
                continue
            self._dispatch(outputs)
            if not ops and not outputs and not self.engine.stats().num_running:
                # NOTE: requests wait but none fits (their blocks are held, e.g.
                # by a decode worker's reservations), and nothing runs that could
                # free blocks: only an op can change that. Wait for one instead
                # of spinning a core on empty steps.
                self._wake.clear()
                with self._ops_lock:
                    idle = not self._ops
                if idle:
                    await self._sleep()

    async def _sleep(self) -> None:
        """Wait for an op (``_wake`` cleared by the caller); lend this
        worker's cores meanwhile."""
        if self.cores is not None:
            self.cores.idle()  # NOTE: the engine thread is not running: safe from here
        await self._wake.wait()

    def _tick(self, ops, loop) -> tuple[list[RequestOutput], Exception | None]:
        """Run the ops, hand their results back, then step once."""
        results, outputs = [], []
        for fn, _, emits in ops:
            try:
                value = fn(self.engine)
                if emits:
                    outputs.extend(value or [])
                    value = None
                results.append((True, value))
            except Exception as exc:
                results.append((False, exc))
        if ops:
            # NOTE: now, not after the step: a reservation, an abort or a
            # release answers (and a started request's first output goes out)
            # without waiting for a step of every running request. Queued
            # before this tick returns, so they land before its outputs.
            loop.call_soon_threadsafe(self._finish_ops, ops, results, outputs)
            outputs = []
        if self.engine.has_unfinished_requests():
            if self.cores is not None:
                self.cores.begin_step()
            try:
                outputs.extend(self.engine.step())
            except Exception as exc:
                return outputs, exc
            finally:
                if self.cores is not None:
                    self.cores.end_step(busy=self.engine.has_unfinished_requests())
        return outputs, None

    def _finish_ops(self, ops, results, outputs: list[RequestOutput]) -> None:
        """On the event loop: the ops' results, and the outputs they made."""
        for (_, future, _), (ok, value) in zip(ops, results):
            if future.done():
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for hook in self.step_hooks:
            hook(outputs)
