"""One request's journey through the workers, with its failure semantics.

    reserve on a decode worker ──> prefill worker pushes KV, returns token 1
            └──────────── decode worker streams tokens 2.. ────────────┘

- No room on any decode worker: ``Overloaded`` before any compute is spent.
- A failure before the client has a token: retry on other workers.
- A failure after: migrate to another decode worker with prompt + tokens so
  far (it recomputes them), so the stream goes on without duplicates or gaps;
  when no worker is left, the stream ends with an error.
- Cancellation (client disconnect): abort on every worker holding the request.

A request with ``n > 1`` runs as ``n`` sequences ``{id}-{i}`` with seed
``seed + i``, exactly as the engine forks them offline. Each sequence then
has a state record of its own, fenced on its own attempts (one completion's
retry must not silence the others' writes); the request's record follows
the latest change of any of them and ends with the request's outcome.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from engine.sampling_params import SamplingParams
from gateway.router import WorkerPool, WorkerView
from gateway.state import State, StateStore
from rpc.convert import params_to_proto
from rpc.errors import Overloaded, TandemError, from_rpc_error
from rpc.logs import request_id_var
from rpc.protos import worker_pb2
from rpc.tracing import current, end_span, tracer

logger = logging.getLogger("gateway")
_tracer = tracer("tandem.gateway")

# Status codes after which the same call may work on another worker.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}


LEASE_MS_PER_PROMPT_TOKEN = 25


class StreamFailed(TandemError):
    """The workers failed the request and no retry or migration was left
    (REST 502, gRPC UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE


@dataclass
class Chunk:
    """A piece of one completion, as the APIs stream it."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list = field(default_factory=list)  # TokenLogprobs protos
    finish_reason: str | None = None
    stop_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list = field(default_factory=list)


@dataclass
class Sequence:
    request_id: str
    index: int
    prompt: list[int]
    params: SamplingParams
    sent: list[int] = field(default_factory=list)
    holders: set[str] = field(default_factory=set)  # worker addresses holding it now
    attempt: int = 0
    prompt_logprobs: list = field(default_factory=list)  # from the prefill worker
    record_id: str = ""  # the request's state record: its id without the -{index}
    trace_ctx: otel_context.Context | None = None  # parent of this sequence's spans
    aborted: bool = False  # by an Abort call: no retry, no migration
    outcome: State | None = None  # how this sequence itself ended


class Orchestrator:
    def __init__(self, pool: WorkerPool, store: StateStore, transport: str = "grpc",
                 lease_ms: int = 30_000, max_attempts: int = 3) -> None:
        self.pool = pool
        self.store = store
        self.transport = transport
        self.lease_ms = lease_ms
        self.max_attempts = max_attempts
        self._winding_up: set[asyncio.Task] = set()  # strong references until done
        self._active: dict[str, list[Sequence]] = {}  # request id -> its sequences

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       trace_parent: otel_context.Context | None = None,
                       ) -> AsyncIterator[Chunk]:
        """Chunks of all ``n`` completions, interleaved as they come. Spans
        of the workers' calls are children of ``trace_parent``."""
        span = _tracer.start_span("gateway.route_and_stream", context=trace_parent,
                                  attributes={"request_id": request_id, "n": params.n,
                                              "prompt_tokens": len(prompt)})
        ctx = trace.set_span_in_context(span)
        record = {"prompt_tokens": len(prompt), "params": json.dumps(dataclasses.asdict(params)),
                  "tokens_sent": 0, "n": params.n}
        await self.store.create(request_id, record)
        seqs = [
            Sequence(
                request_id if params.n == 1 else f"{request_id}-{i}", i, prompt,
                dataclasses.replace(params, n=1,
                                    seed=None if params.seed is None else params.seed + i),
                record_id=request_id, trace_ctx=ctx,
            )
            for i in range(params.n)
        ]
        if params.n > 1:
            await asyncio.gather(*(
                self.store.create(s.request_id, {**record, "n": 1, "index": s.index,
                                                 "parent": request_id})
                for s in seqs
            ))
        self._active[request_id] = seqs
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(s, queue)) for s in seqs]
        final, done, error = State.FINISHED, 0, None
        try:
            while done < len(seqs):
                item = await queue.get()
                if isinstance(item, BaseException):
                    final, error = State.FAILED, item
                    raise item
                if item is None:
                    done += 1
                    continue
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            final = State.ABORTED
            raise
        finally:
            span.set_attribute("state", final.value)
            end_span(span, error)
            self._active.pop(request_id, None)
            for t in tasks:
                t.cancel()
            # NOTE: wound up in a task of its own. Starlette cancels a
            # disconnected client's stream with an anyio cancel scope, which
            # cancels every await made here again: awaited in place, the final
            # state (ABORTED) was never written.
            wind_up = asyncio.ensure_future(self._wind_up(tasks, request_id, seqs, final))
            self._winding_up.add(wind_up)
            wind_up.add_done_callback(self._winding_up.discard)
            await asyncio.shield(wind_up)

    async def _wind_up(self, tasks: list[asyncio.Task], request_id: str, seqs: list[Sequence],
                       final: State) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._finish(request_id, seqs, final)

    async def _pump(self, seq: Sequence, queue: asyncio.Queue) -> None:
        request_id_var.set(seq.record_id or seq.request_id)  # this task's log lines
        try:
            async for chunk in self._run(seq):
                queue.put_nowait(chunk)
            seq.outcome = State.FINISHED
            queue.put_nowait(None)
        except asyncio.CancelledError:
            seq.outcome = State.ABORTED
            await asyncio.shield(self._abort_everywhere(seq))
            raise
        except BaseException as exc:
            seq.outcome = State.FAILED
            await asyncio.shield(self._abort_everywhere(seq))
            queue.put_nowait(exc)

    async def _finish(self, request_id: str, seqs: list[Sequence], state: State) -> None:
        end = f"{time.time():.3f}"
        writes = [(request_id, self._record_attempt(seqs[0]), state,
                   sum(len(s.sent) for s in seqs))]
        if len(seqs) > 1:  # each completion ends as it ended itself
            writes += [(s.request_id, s.attempt, s.outcome or state, len(s.sent)) for s in seqs]
        for record_id, attempt, final, sent in writes:
            try:
                await self.store.update(record_id, attempt, {
                    "state": final, "tokens_sent": sent, "finished": end})
            except Exception:
                logger.exception("could not record the end of %s", record_id)

    @staticmethod
    def _record_attempt(seq: Sequence) -> int:
        """The attempt a write to the request's record carries: the
        sequence's own when it is the request (n = 1); 0 when the record
        summarises several sequences, whose fencing is on their own records."""
        return seq.attempt if seq.request_id == seq.record_id else 0

    # ---- one sequence, with retries --------------------------------------------------

    async def _run(self, seq: Sequence) -> AsyncIterator[Chunk]:
        tried: set[str] = set()
        last_error: Exception | None = None
        while seq.attempt < self.max_attempts:
            seq.attempt += 1
            if seq.aborted:
                break
            try:
                async for chunk in self._attempt(seq, tried):
                    yield chunk
                return
            except Overloaded:
                if not seq.sent:
                    raise  # no decode worker has room: the client gets 429
                last_error = StreamFailed("no decode worker has room to continue the request")
            except grpc.aio.AioRpcError as err:
                if err.code() not in RETRYABLE:
                    raise from_rpc_error(err) from None
                logger.warning("%s attempt %d failed (%s: %s); %s", seq.request_id, seq.attempt,
                               err.code().name, err.details(),
                               "migrating" if seq.sent else "retrying")
                last_error = err
            await self._abort_everywhere(seq)
        if seq.aborted:
            yield Chunk(index=seq.index, token_ids=[], text="", finish_reason="abort",
                        prompt_tokens=len(seq.prompt))
            return
        if seq.sent:
            raise StreamFailed(f"request failed after {len(seq.sent)} tokens: {last_error}")
        if isinstance(last_error, grpc.aio.AioRpcError):
            if last_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise Overloaded(last_error.details()) from None
            # NOTE: not the worker's own status: a worker's NOT_FOUND or
            # UNAVAILABLE would reach the client as "model not found" or
            # "draining"; what failed is the cluster behind the gateway.
            raise StreamFailed(f"no worker could serve the request after {seq.attempt} "
                               f"attempts: {last_error.code().name}: "
                               f"{last_error.details()}") from None
        raise last_error or Overloaded("no worker could take the request")

    async def _attempt(self, seq: Sequence, tried: set[str]) -> AsyncIterator[Chunk]:
        needed = len(seq.prompt) + len(seq.sent) + 1
        candidates = self.pool.decode_candidates(needed, tried)
        if not candidates:
            raise Overloaded("no decode worker has room for the request")
        params = params_to_proto(seq.params)
        if self.pool.colocated or seq.sent:
            # The worker runs the whole request: colocated, or a migration that
            # recomputes prompt + tokens already sent.
            decode = candidates[0]
            request = worker_pb2.DecodeRequest(
                request_id=seq.request_id, prompt_token_ids=seq.prompt,
                output_token_ids=seq.sent, params=params, attempt=seq.attempt,
            )
            await self._state(seq, State.DECODING, decode=decode)
        else:
            decode, ticket = await self._reserve(seq, candidates, params)
            first = await self._prefill(seq, ticket, params, tried)
            request = worker_pb2.DecodeRequest(
                request_id=seq.request_id, first_token_id=first.first_token_id,
                first_logprobs=first.first_logprobs if first.HasField("first_logprobs")
                else None, params=params, attempt=seq.attempt,
            )
            await self._state(seq, State.DECODING, decode=decode)
            seq.prompt_logprobs = list(first.prompt_logprobs)
        tried.add(decode.address)
        seq.holders.add(decode.address)
        decode.inflight += 1
        span = _tracer.start_span("gateway.decode", context=seq.trace_ctx,
                                  attributes={"worker": decode.address,
                                              "migrated": bool(seq.sent)})
        error: BaseException | None = None
        try:
            first_chunk, finished = True, False
            with current(span):
                stream = self.pool.stub(decode.address).Decode(request)
            async for c in stream:
                chunk = Chunk(
                    index=seq.index, token_ids=list(c.token_ids), text=c.text,
                    logprobs=list(c.logprobs), finish_reason=c.finish_reason or None,
                    stop_reason=c.stop_reason, prompt_tokens=c.usage.prompt_tokens,
                    cached_tokens=c.usage.cached_tokens,
                    prompt_logprobs=list(c.prompt_logprobs),
                )
                if first_chunk and not chunk.prompt_logprobs:
                    chunk.prompt_logprobs = seq.prompt_logprobs
                first_chunk = False
                seq.sent.extend(chunk.token_ids)
                yield chunk
                if chunk.finish_reason:
                    finished = True
                    # NOTE: read on to the stream's end (it ends right after
                    # this chunk) so the call completes now, not whenever it
                    # is garbage collected.
            if finished:
                return
        except BaseException as exc:
            error = exc
            raise
        finally:
            span.set_attribute("tokens", len(seq.sent))
            end_span(span, error)
            decode.inflight -= 1
            if error is None:
                seq.holders.discard(decode.address)
            # else: it stays a holder, so the Abort that precedes a retry reaches
            # it before the retry can reuse the request id there.
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None,
                                   details="decode stream ended without a finish reason")

    async def _reserve(self, seq: Sequence, candidates: list[WorkerView], params):
        refused: grpc.aio.AioRpcError | None = None
        unreachable: grpc.aio.AioRpcError | None = None
        full = False
        for decode in candidates:
            span = _tracer.start_span("gateway.reserve", context=seq.trace_ctx,
                                      attributes={"worker": decode.address})
            try:
                with current(span):
                    call = self.pool.stub(decode.address).Reserve(worker_pb2.ReserveRequest(
                        request_id=seq.request_id, prompt_token_ids=seq.prompt, params=params,
                        lease_ms=self._lease_ms(len(seq.prompt)), attempt=seq.attempt,
                    ), timeout=10.0)
                reply = await call
                span.set_attribute("blocks", len(reply.ticket.block_ids))
                end_span(span)
            except grpc.aio.AioRpcError as err:
                end_span(span, err)
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    # Parameters the gateway let through are fine everywhere; what
                    # one worker refuses is its own limit (a smaller KV cache than
                    # the request needs in all): another worker may be bigger.
                    refused = err
                elif err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full = True
                else:
                    unreachable = err
                logger.info("reserve on %s failed: %s", decode.address, err.details())
                continue
            seq.holders.add(decode.address)
            decode.free_blocks -= len(reply.ticket.block_ids)
            return decode, reply.ticket
        if refused is not None and not full:
            raise refused
        if unreachable is not None and not full:
            raise unreachable  # retried: the pool will have noticed the dead worker
        raise Overloaded("no decode worker has room for the request")

    def _lease_ms(self, prompt_tokens: int) -> int:
        """The reservation must outlive the prompt's queueing and compute on
        the prefill worker, which grows with the prompt (seconds per thousand
        tokens on a CPU): the configured base plus a margin per token."""
        return self.lease_ms + LEASE_MS_PER_PROMPT_TOKEN * prompt_tokens

    async def _prefill(self, seq: Sequence, ticket, params, tried: set[str]):
        prefill = self.pool.pick_prefill(seq.prompt, tried) or self.pool.pick_prefill(
            seq.prompt, set())
        if prefill is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None,
                                       details="no prefill worker is available")
        # NOTE: counted before the first await, so that requests arriving
        # together see each other's load when they pick.
        seq.holders.add(prefill.address)
        prefill.inflight += 1
        span = _tracer.start_span("gateway.prefill", context=seq.trace_ctx,
                                  attributes={"worker": prefill.address,
                                              "transport": self.transport})
        try:
            await self._state(seq, State.PREFILLING, prefill=prefill)
            with current(span):
                call = self.pool.stub(prefill.address).Prefill(worker_pb2.PrefillRequest(
                    request_id=seq.request_id, prompt_token_ids=seq.prompt, params=params,
                    ticket=ticket, transport=self.transport,
                ))
            reply = await call
            span.set_attribute("kv_bytes", reply.kv_bytes)
            end_span(span)
            return reply
        except grpc.aio.AioRpcError as err:
            end_span(span, err)
            tried.add(prefill.address)
            raise
        except BaseException as exc:
            end_span(span, exc)
            raise
        finally:
            prefill.inflight -= 1
            seq.holders.discard(prefill.address)

    async def _state(self, seq: Sequence, state: State, decode: WorkerView | None = None,
                     prefill: WorkerView | None = None) -> None:
        fields: dict = {"state": state, "tokens_sent": len(seq.sent)}
        if decode is not None:
            fields["decode_worker"] = decode.worker_id or decode.address
        if prefill is not None:
            fields["prefill_worker"] = prefill.worker_id or prefill.address
        # NOTE: with n > 1 every sequence, index 0 included, is "{id}-{i}" and
        # has its own record; the request's record follows along unfenced.
        if seq.record_id and seq.record_id != seq.request_id:
            await self.store.update(seq.request_id, seq.attempt, fields)
            fields = {"state": state}  # a sequence's count is not the request's
        await self.store.update(seq.record_id or seq.request_id, self._record_attempt(seq),
                                fields)

    async def _abort_everywhere(self, seq: Sequence) -> None:
        """Best effort: every worker that may hold blocks of ``seq`` frees them."""
        holders, seq.holders = set(seq.holders), set()
        await asyncio.gather(*(
            self.pool.stub(a).Abort(worker_pb2.AbortRequest(request_id=seq.request_id),
                                    timeout=5.0)
            for a in holders
        ), return_exceptions=True)

    async def abort(self, request_id: str) -> bool:
        """Abort by id from outside the request's own stream (all workers).
        Returns whether this gateway is running the request."""
        seqs = self._active.get(request_id)
        for seq in seqs or ():
            seq.aborted = True
        # With n > 1 the workers know the sequences ("{id}-{i}"), not the request.
        ids = [s.request_id for s in seqs] if seqs else [request_id]
        addresses = [w.address for w in self.pool.workers.values() if w.healthy]
        await asyncio.gather(*(
            self.pool.stub(a).Abort(worker_pb2.AbortRequest(request_id=rid), timeout=5.0)
            for a in addresses for rid in ids
        ), return_exceptions=True)
        return seqs is not None
