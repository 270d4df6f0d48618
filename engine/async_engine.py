"""An asyncio front for LLMEngine.

The engine is single-threaded: every mutation (add, abort, step, and the
workers' reservation calls) runs on one engine thread, between steps, so the
event loop never blocks on the model and the engine never sees two callers
at once. The one exception is ``run_concurrently``: a call that no forward
pass reads (a decode worker's reservation) runs on the event loop at once
while the engine thread is inside a forward pass or idle, under the lock
that the engine thread holds everywhere else.

Given a function that builds the engine instead of an engine, the engine
thread builds it too. That matters on the CPU: OpenMP (libgomp) keeps a
team of threads per thread that ever ran a parallel region, and once a
process holds more team threads than it has cores, every team stops
spinning between regions and sleeps instead. A model loaded on the main
thread and stepped on this one was two teams on two cores: each decode step
of 64 requests went from 49 to 69 ms, waking the other thread of the team
hundreds of times a step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from engine.core_lease import CoreLease
from engine.errors import EngineUnusable
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams

logger = logging.getLogger("engine")
T = TypeVar("T")


class AsyncEngineLoop:
    """Runs an LLMEngine on a thread of its own, stepping while there is
    work, and hands its outputs to asyncio streams (on the event loop of the
    latest caller). Workers hold one; the
    public ``tandem.AsyncEngine`` is one built from vLLM-style arguments."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 cores: CoreLease | None = None) -> None:
        """``engine``: an engine, or a function that builds one on the
        engine thread (started here; what it raises is raised here);
        ``cores``: cores shared with other workers on this host, held
        around each step (engine/core_lease.py); None: the process's own."""
        self.cores = cores
        self._ops: list[tuple[Callable[[LLMEngine], Any], asyncio.Future, bool]] = []
        # Guards _ops and _stop; the engine thread waits on it while idle.
        self._cv = threading.Condition()
        # Held by the engine thread while it uses the engine, except in a
        # forward pass (and while idle): run_concurrently's calls take it.
        self._state = threading.Lock()
        self._stop = False
        self._streams: dict[str, RequestStream] = {}
        self._ops_run = 0  # ops run so far, counted on the engine thread
        self._thread: threading.Thread | None = None  # started by the first op
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
        if isinstance(engine, LLMEngine):
            self.engine = engine  # its thread starts with the first op
        else:
            self._build_on_engine_thread(engine)
        self.engine.on_unusable(self._mark_unusable)

    def _build_on_engine_thread(self, make_engine: Callable[[], LLMEngine]) -> None:
        built: concurrent.futures.Future = concurrent.futures.Future()

        def body() -> None:
            try:
                self.engine = make_engine()
            except BaseException as exc:  # noqa: BLE001 - handed to the constructor
                built.set_exception(exc)
                return
            built.set_result(None)
            self._run()

        self._thread = threading.Thread(target=body, name="engine", daemon=True)
        self._thread.start()
        built.result()

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
        stream = RequestStream()
        # Registered before the add: the add's own step may already produce output.
        self._streams[request_id] = stream

        def add_here(engine: LLMEngine) -> list[RequestOutput] | None:
            stream.since = self._ops_run
            return add(engine)

        try:
            await self.run(add_here, emits_outputs=True)
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
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._closed:
                # NOTE: queued now, not by a task that starts later: an add of
                # the same id that comes next must find this request gone.
                done = self._submit(lambda engine: engine.abort_request(request_id), False)
                self._run_hooks(await asyncio.shield(done))

    async def abort(self, request_id: str) -> None:
        """Abort a request; when this returns its blocks are free, and its
        stream (if one is open) has the abort's output."""
        stream = self._streams.get(request_id)
        outs = await self.run(lambda engine: engine.abort_request(request_id))
        # NOTE: only to the stream this abort was for. Once that stream has
        # gone, the id may name a new request already (a retry started at
        # once), which the old request's "abort" must not end.
        if stream is not None and self._streams.get(request_id) is stream:
            for out in outs:
                stream.queue.put_nowait(out)
        self._run_hooks(outs)

    async def run(self, fn: Callable[[LLMEngine], T], emits_outputs: bool = False) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps. With
        ``emits_outputs``, ``fn`` returns RequestOutputs (or None) that are
        dispatched before the outputs of the step that follows it."""
        return await self._submit(fn, emits_outputs)

    async def run_concurrently(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on this thread right away if the engine thread
        is in a forward pass or idle and no op waits, else as ``run`` does.
        Only for a ``fn`` that emits no outputs and touches nothing a
        forward pass reads: a reservation, whose blocks no scheduled request
        holds, may; adding or stepping a request may not.

        NOTE: a reservation made between two steps waited for the step
        under way: 13 ms (p50) of every remote prompt's time to first token
        at 6 requests/s, 1P+1D on two cores."""
        if not self._closed and self._state.acquire(blocking=False):
            try:
                with self._cv:
                    waiting = bool(self._ops)  # then ``fn`` would overtake them
                if not waiting:
                    return fn(self.engine)
            finally:
                self._state.release()
        return await self.run(fn)

    def _submit(self, fn: Callable[[LLMEngine], T], emits_outputs: bool) -> asyncio.Future:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        self._event_loop = loop  # results and outputs go to the latest caller's loop
        future: asyncio.Future = loop.create_future()
        with self._cv:
            self._ops.append((fn, future, emits_outputs))
            self._cv.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
                self._thread.start()
        return future

    async def shutdown(self) -> None:
        """Stop the engine thread (after the step it is in) and the engine."""
        self._closed = True
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self.cores is not None:
            self.cores.close()
        self.engine.shutdown()

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    # ---- the loop ------------------------------------------------------------------

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop of the latest caller (from the
        engine thread); dropped when that loop has closed."""
        loop = self._event_loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody waits for these any more
            pass

    def _must_wait(self, until_op: bool) -> bool:
        """Under ``_cv``: nothing to do until an op comes (or a stop)."""
        return (not self._stop and not self._ops
                and (until_op or not self.engine.has_unfinished_requests()))

    def _run(self) -> None:
        """The engine thread: run the ops, step while there is work, hand
        the outputs to the event loop, and sleep when idle.

        NOTE: a thread that loops by itself, not a task that awaits each step
        in an executor: there the next step started only once the event loop
        had come round to it, behind the last step's streams (a 64-stream
        decode waited 0.6-13 ms a step, 5.5 on average)."""
        until_op = False
        while True:
            with self._cv:
                idle = self._must_wait(until_op)
            if idle:
                if self.cores is not None:
                    self.cores.idle()  # lend this worker's cores while it sleeps
                with self._cv:
                    while self._must_wait(until_op):
                        self._cv.wait()
            with self._state:
                # NOTE: ops are taken and run under the lock, so that one who
                # holds it and finds none queued knows every earlier op ran.
                with self._cv:
                    if self._stop:
                        return
                    ops, self._ops = self._ops, []
                self._run_ops(ops)
            steps = self.engine.num_steps
            outputs, failed = self._step()
            until_op = False
            if failed is not None:  # the model failed: fail what was running, keep serving
                logger.error("engine step failed", exc_info=failed)
                try:
                    with self._state:
                        aborted = self.engine.recover_from_failed_step()
                except Exception:
                    logger.exception("recovering from the failed step failed")
                    aborted = []
                self._post(self._fail_streams, aborted, failed, self._ops_run)
                continue
            self._post(self._dispatch, outputs, self._ops_run)
            # NOTE: the scheduler ran nothing (blocks held by reservations): only
            # an op can change that, so wait for one. Not "no outputs, none
            # running": a step that preempted all that ran has neither.
            until_op = not ops and self.engine.num_steps == steps

    def _fail_streams(self, aborted: list[str], failed: Exception, stamp: int) -> None:
        """On the event loop: end the streams of the requests a failed step aborted."""
        for request_id in aborted:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(RuntimeError(f"engine step failed: {failed}"), stamp)
        if isinstance(failed, EngineUnusable):
            self.unusable.set()  # also done by the watcher; harmless twice

    def _run_ops(self, ops) -> None:
        """Run the ops and hand their results back."""
        results, emitted = [], []
        for fn, _, emits in ops:
            self._ops_run += 1
            try:
                value = fn(self.engine)
                if emits:
                    emitted.append((self._ops_run, value or []))
                    value = None
                results.append((True, value))
            except Exception as exc:
                results.append((False, exc))
        if ops:
            # NOTE: now, not after the step: a reservation, an abort or a
            # release answers (and a started request's first output goes out)
            # without waiting for a step of every running request. Queued
            # before this tick returns, so they land before its outputs.
            self._post(self._finish_ops, ops, results, emitted)

    def _step(self) -> tuple[list[RequestOutput], Exception | None]:
        """One step, if there is work: its outputs, or what it raised.

        Waiting for this worker's cores (a neighbour's borrowed step at
        most) and the forward pass run without ``_state``: the calls that
        ``run_concurrently`` lets in read only what no step changes."""
        engine = self.engine
        if not engine.has_unfinished_requests():
            return [], None
        # NOTE: no borrowing while a prefill worker computes KV for this
        # one: on a shared host it is likely the neighbour whose core a
        # borrowed step would make it wait for (a step of this worker's).
        with (contextlib.nullcontext() if self.cores is None else
              self.cores.step(engine.has_backlog, engine.has_unfinished_requests,
                              borrow=not engine.awaits_remote_kv())), self._state:
            try:
                return engine.step(forward=self._unlocked), None
            except Exception as exc:
                return [], exc

    @contextlib.contextmanager
    def _unlocked(self):
        """Around a forward pass on the engine thread: ``_state`` is free."""
        self._state.release()
        try:
            yield
        finally:
            self._state.acquire()

    def _finish_ops(self, ops, results, emitted: list[tuple[int, list[RequestOutput]]]) -> None:
        """On the event loop: the ops' results, and the outputs they made
        (with the number of the op that made them)."""
        for (_, future, _), (ok, value) in zip(ops, results):
            if future.done():
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        for stamp, outputs in emitted:
            self._deliver(outputs, stamp)

    def _deliver(self, outputs: list[RequestOutput], stamp: int) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out, stamp)

    def _dispatch(self, outputs: list[RequestOutput], stamp: int) -> None:
        """On the event loop: a step's outputs to their streams and the hooks."""
        self._deliver(outputs, stamp)
        self._run_hooks(outputs)

    def _run_hooks(self, outputs: list[RequestOutput]) -> None:
        for hook in self.step_hooks:
            hook(outputs)
