"""One attempt of one sequence against a decode worker (and a prefill worker
before it), with a span around every call.

    reserve on a decode worker ──> prefill worker pushes KV, returns token 1
                                   (sent to the client at once)
            └──────────── decode worker streams tokens 2.. ────────────┘

When token 1 already ends the request (EOS, a stop token or string,
max_tokens 1) there is no Decode call: the reservation is aborted. A
colocated cluster, a migration (tokens already sent), or a prompt the
disaggregation policy keeps local (gateway/disagg_policy.py) skips the
first line: the decode worker runs the whole request.

A failed call to a worker leaves as gateway/attempt_failure.py decides:
``AttemptFailed`` (retry or migrate) or the client's own error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from gateway.attempt_failure import (
    AttemptFailed,
    NoWorkerAvailable,
    stop_if_aborted,
    worker_failure,
)
from gateway.decode_mux import MuxedDecode
from gateway.disagg_policy import Decision, DisaggPolicy
from gateway.pair_health import HANDOFF_FAILURES
from gateway.request_record import RequestRecords
from gateway.router import WorkerPool, WorkerView
from gateway.sequence import Chunk, Sequence
from gateway.stall import StallWatch
from gateway.state import State
from rpc.convert import params_to_proto, stop_reason_from_proto
from rpc.errors import Overloaded
from rpc.protos import worker_pb2
from rpc.tracing import current, end_span, tracer

logger = logging.getLogger("gateway")
_tracer = tracer("tandem.gateway")

LEASE_MS_PER_PROMPT_TOKEN = 25
# How long a retry waits for the previous attempt's aborts. One that takes
# longer (a frozen worker) goes on in the background, and its worker is not
# given the sequence again until it has answered or timed out.
ABORT_WAIT_S = 0.5
ABORT_TIMEOUT_S = 5.0


class Attempts:
    def __init__(self, pool: WorkerPool, records: RequestRecords, transport: str,
                 lease_ms: int, stall_timeout_s: float, policy: DisaggPolicy | None = None,
                 on_decision=None) -> None:
        """``on_decision(Decision)``: observes every choice of where to prefill."""
        self.pool = pool
        self.policy = policy or DisaggPolicy()
        self.on_decision = on_decision
        self.records = records
        self.transport = transport
        self.lease_ms = lease_ms
        self.stall_timeout_s = stall_timeout_s
        self._aborts: set[asyncio.Task] = set()  # strong references until done

    async def run(self, seq: Sequence, tried: set[str]) -> AsyncIterator[Chunk]:
        """The chunks of one attempt, to the finish reason. Raises
        ``Overloaded`` when no decode worker has room, ``AttemptFailed`` or a
        client error (see the module's docstring). Adds the workers used to
        ``tried``; those still holding the sequence stay in ``seq.holders``."""
        try:
            async for chunk in self._run(seq, tried):
                yield chunk
        except grpc.aio.AioRpcError as err:
            raise worker_failure(err) from None

    async def _run(self, seq: Sequence, tried: set[str]) -> AsyncIterator[Chunk]:
        needed = len(seq.prompt) + len(seq.sent) + 1
        candidates = self.pool.decode_candidates(needed, tried, exclude=seq.aborting)
        if not candidates:
            workers = self.pool.decode_workers()
            if not workers:
                raise NoWorkerAvailable("no decode worker is available")
            largest = max(w.num_blocks * w.block_size for w in workers)
            if needed > largest and not seq.sent:
                # Never, not just not now: a 400, as the worker itself would answer.
                raise ValueError(f"the request needs the KV cache of {needed} tokens, the "
                                 f"largest decode worker's holds {largest}")
            raise Overloaded("no decode worker has room for the request")
        params = params_to_proto(seq.params)
        prefill_cached = 0  # prompt tokens the prefill worker found in its cache
        local = self.pool.colocated or bool(seq.sent) or not self._decide(seq, candidates,
                                                                          tried).remote
        if local:
            # The worker runs the whole request: colocated, a migration that
            # recomputes prompt + tokens already sent, or the policy's choice.
            decode = candidates[0]
            request = worker_pb2.DecodeRequest(
                request_id=seq.request_id, prompt_token_ids=seq.prompt,
                output_token_ids=seq.sent, params=params, attempt=seq.attempt,
                local_prefill=not self.pool.colocated and not seq.sent,
            )
            if not seq.sent:
                self.policy.routed(decode.address, seq.prompt, decode.block_size)
            await self.records.state(seq, State.DECODING, decode=decode)
        else:
            decode, ticket = await self._reserve(seq, candidates, params)
            stop_if_aborted(seq)
            first = await self._prefill(seq, ticket, params, tried, decode)
            stop_if_aborted(seq)
            chunk = _first_chunk(seq, first)
            if chunk.finish_reason:
                # The first token ended the request: no Decode call; the
                # reservation (the KV just pushed there) is released.
                seq.sent.extend(chunk.token_ids)
                yield chunk
                await self.abort_everywhere(seq)
                return
            await self.records.state(seq, State.DECODING, decode=decode)
            # The client has the first token now, not after a Decode round trip.
            seq.sent.extend(chunk.token_ids)
            yield chunk
            request = worker_pb2.DecodeRequest(
                request_id=seq.request_id, first_token_id=first.first_token_id,
                first_logprobs=first.first_logprobs if first.HasField("first_logprobs")
                else None, params=params, attempt=seq.attempt, first_token_sent=True,
            )
            prefill_cached = first.num_cached_tokens
        async for chunk in self._decode(seq, decode, request, tried, prefill_cached):
            yield chunk

    def _decide(self, seq: Sequence, candidates: list[WorkerView], tried: set[str]) -> Decision:
        """Prefill remotely or on ``candidates[0]``; the choice and its
        inputs go on a span of the request and to ``on_decision``."""
        decode = candidates[0]
        prefill = self._pick_prefill(seq, tried, decode)
        if prefill is None and self._kept_apart(decode):
            # Whatever the policy: the prompt can reach this decode worker
            # only by being computed there.
            decision = Decision(False, "handoffs to this decode worker are failing", {})
        else:
            decision = self.policy.decide(seq.prompt, decode, prefill, decode.kv_bytes_per_token)
        span = _tracer.start_span("gateway.disagg_decision", context=seq.trace_ctx, attributes={
            "policy": self.policy.policy, "remote": decision.remote, "reason": decision.reason,
            "decode": decode.address, "prefill": prefill.address if prefill else "",
            **{f"input.{k}": v for k, v in decision.inputs.items()}})
        end_span(span)
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision

    async def _reserve(self, seq: Sequence, candidates: list[WorkerView], params):
        refused: grpc.aio.AioRpcError | None = None
        unreachable: grpc.aio.AioRpcError | None = None
        full = False
        for decode in candidates:
            span = _tracer.start_span("gateway.reserve", context=seq.trace_ctx,
                                      attributes={"worker": decode.address})
            # NOTE: a holder from before the call: cancelled while it is in
            # flight, the reservation may exist there all the same.
            seq.holders.add(decode.address)
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
                    seq.holders.discard(decode.address)  # refused: nothing reserved
                elif err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full = True
                    seq.holders.discard(decode.address)  # full: nothing reserved
                else:
                    # NOTE: a holder still: a reserve that timed out (or whose
                    # answer was lost) may have reserved all the same, and a
                    # retry under the same id there would be refused as a
                    # duplicate; abort_everywhere frees it before any retry.
                    unreachable = err
                logger.info("reserve on %s failed: %s", decode.address, err.details())
                continue
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

    def _pick_prefill(self, seq: Sequence, tried: set[str], decode: WorkerView):
        """An untried prefill worker for ``decode``, else any that is not
        still aborting the sequence."""
        return (self.pool.pick_prefill(seq.prompt, tried, decode.address)
                or self.pool.pick_prefill(seq.prompt, seq.aborting, decode.address))

    def _kept_apart(self, decode: WorkerView) -> bool:
        """Some prefill worker is in rotation, but kept apart from ``decode``."""
        return any(self.pool.pairs.apart(p.address, decode.address)
                   for p in self.pool.usable(("prefill",)))

    async def _prefill(self, seq: Sequence, ticket, params, tried: set[str],
                       decode: WorkerView):
        prefill = self._pick_prefill(seq, tried, decode)
        if prefill is None:
            tried.add(decode.address)
            raise AttemptFailed(grpc.StatusCode.UNAVAILABLE, "no prefill worker is available"
                                + (f" for decode worker {decode.address}"
                                   if self._kept_apart(decode) else ""))
        # NOTE: counted before the first await, so that requests arriving
        # together see each other's load when they pick.
        seq.holders.add(prefill.address)
        prefill.inflight += 1
        span = _tracer.start_span("gateway.prefill", context=seq.trace_ctx,
                                  attributes={"worker": prefill.address,
                                              "transport": self.transport})
        try:
            await self.records.state(seq, State.PREFILLING, prefill=prefill)
            with current(span):
                call = self.pool.stub(prefill.address).Prefill(worker_pb2.PrefillRequest(
                    request_id=seq.request_id, prompt_token_ids=seq.prompt, params=params,
                    ticket=ticket, transport=self.transport,
                ))
            start = time.monotonic()
            reply = await call
            span.set_attribute("kv_bytes", reply.kv_bytes)
            end_span(span)
            self.pool.pairs.succeeded(prefill.address, decode.address)
            self.policy.routed(prefill.address, seq.prompt, prefill.block_size)
            self.policy.observe_prefill(
                prefill.address, ticket.decode_address, len(seq.prompt) - reply.num_cached_tokens,
                time.monotonic() - start, reply.kv_bytes, reply.transfer_seconds)
            return reply
        except grpc.aio.AioRpcError as err:
            end_span(span, err)
            tried.add(prefill.address)
            if err.code() in HANDOFF_FAILURES:
                # Either side may be at fault: the retry prefers others for both.
                tried.add(decode.address)
                self.pool.pairs.failed(prefill.address, decode.address, err.code().name)
            raise worker_failure(err, handoff=True) from None
        except BaseException as exc:
            end_span(span, exc)
            raise
        finally:
            prefill.inflight -= 1
            seq.holders.discard(prefill.address)

    async def _decode(self, seq: Sequence, decode: WorkerView,
                      request: worker_pb2.DecodeRequest, tried: set[str],
                      prefill_cached: int = 0) -> AsyncIterator[Chunk]:
        """``prefill_cached``: the prompt's cached tokens where it was computed
        (a prefill worker), which the decode worker, given the KV, cannot know."""
        tried.add(decode.address)
        seq.holders.add(decode.address)
        decode.inflight += 1
        span = _tracer.start_span("gateway.decode", context=seq.trace_ctx,
                                  attributes={"worker": decode.address,
                                              "migrated": bool(request.output_token_ids)})
        error: BaseException | None = None
        watch: StallWatch | None = None
        stream: MuxedDecode | None = None
        try:
            finished = False
            with current(span):
                stream = self.pool.decode(decode.address, request)
            watch = StallWatch(decode, self.stall_timeout_s, stream)
            async for c in stream:
                watch.progress()
                stop_if_aborted(seq)
                chunk = Chunk(
                    index=seq.index, token_ids=list(c.token_ids), text=c.text,
                    logprobs=list(c.logprobs), finish_reason=c.finish_reason or None,
                    stop_reason=stop_reason_from_proto(c), prompt_tokens=c.usage.prompt_tokens,
                    cached_tokens=max(c.usage.cached_tokens, prefill_cached),
                    # On the completion's first chunk only (a migrated request's
                    # worker computes them again).
                    prompt_logprobs=[] if seq.sent else list(c.prompt_logprobs),
                )
                seq.sent.extend(chunk.token_ids)
                yield chunk
                if chunk.finish_reason:
                    finished = True
                    # NOTE: read on to the stream's end (it ends right after
                    # this chunk) so the call completes now, not whenever it
                    # is garbage collected.
            if finished:
                return
        except asyncio.CancelledError as exc:
            error = exc
            if watch is not None and watch.reason and not _being_cancelled():
                # Our watch cancelled the call, not the client: move the stream.
                logger.warning("%s: %s", seq.request_id, watch.reason)
                error = AttemptFailed(grpc.StatusCode.UNAVAILABLE, watch.reason)
                raise error from None
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if watch is not None:
                watch.close()
            if stream is not None:
                stream.close()  # a request left unread stops on the worker now
            span.set_attribute("tokens", len(seq.sent))
            end_span(span, error)
            decode.inflight -= 1
            if error is None:
                seq.holders.discard(decode.address)
            # else: it stays a holder, so the Abort that precedes a retry reaches
            # it before the retry can reuse the request id there.
        raise AttemptFailed(grpc.StatusCode.UNAVAILABLE,
                            "decode stream ended without a finish reason")

    async def abort_everywhere(self, seq: Sequence) -> None:
        """Best effort: every worker that may hold blocks of ``seq`` frees
        them. Waits ``ABORT_WAIT_S`` at most; a worker still to answer stays
        in ``seq.aborting`` (no new attempt goes there: a late Abort would
        end it) until it answers or its call times out."""
        holders, seq.holders = set(seq.holders), set()
        if not holders:
            return
        seq.aborting |= holders
        calls = [asyncio.ensure_future(self._abort(seq, a)) for a in holders]
        self._aborts.update(calls)
        for call in calls:
            call.add_done_callback(self._aborts.discard)
        await asyncio.wait(calls, timeout=ABORT_WAIT_S)

    async def _abort(self, seq: Sequence, address: str) -> None:
        try:
            await self.pool.stub(address).Abort(
                worker_pb2.AbortRequest(request_id=seq.request_id), timeout=ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            logger.info("abort of %s on %s failed: %s", seq.request_id, address, err.code().name)
        finally:
            seq.aborting.discard(address)


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _first_chunk(seq: Sequence, first: worker_pb2.PrefillResponse) -> Chunk:
    """The completion's first chunk, from the prefill worker's reply: what
    the decode worker's stream would have started with."""
    return Chunk(
        index=seq.index, text=first.text,
        # None: the grammar allowed no first token (it finished the request).
        token_ids=[first.first_token_id] if first.HasField("first_token_id") else [],
        logprobs=[first.first_logprobs] if first.HasField("first_logprobs") else [],
        finish_reason=first.finish_reason or None, stop_reason=stop_reason_from_proto(first),
        prompt_tokens=len(seq.prompt), cached_tokens=first.num_cached_tokens,
        prompt_logprobs=list(first.prompt_logprobs),
    )
