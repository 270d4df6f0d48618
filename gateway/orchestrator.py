"""One request's journey through the workers, with its failure semantics.

- No room on any decode worker: ``Overloaded`` before any compute is spent.
- A failure before the client has a token: retry on other workers.
- A failure after: migrate to another decode worker with prompt + tokens so
  far (it recomputes them), so the stream goes on without duplicates or gaps;
  when no worker is left, the stream ends with an error.
- Cancellation (client disconnect): abort on every worker holding the request.

The pieces: ``sequence.fork`` splits a request into its ``n`` sequences,
``attempt.Attempts`` runs one attempt of one sequence, ``request_record``
writes the state records, ``fan_in.FanIn`` merges the sequences' chunks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from engine.sampling_params import SamplingParams
from gateway.attempt import Attempts
from gateway.attempt_failure import AttemptFailed, NoWorkerAvailable
from gateway.disagg_policy import DisaggPolicy
from gateway.fan_in import FanIn
from gateway.request_record import RequestRecords
from gateway.router import WorkerPool
from gateway.sequence import Chunk, Sequence, fork
from gateway.state import State, StateStore
from rpc.errors import Overloaded, TandemError
from rpc.logs import request_id_var
from rpc.protos import worker_pb2
from rpc.tracing import end_span, tracer

logger = logging.getLogger("gateway")
_tracer = tracer("tandem.gateway")
# Seconds before the second attempt at a request that has no token yet; the
# third waits twice as long.
RETRY_BACKOFF_S = 0.1


class StreamFailed(TandemError):
    """The workers failed the request and no retry or migration was left
    (REST 502, gRPC UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE


class Orchestrator:
    def __init__(self, pool: WorkerPool, store: StateStore, transport: str, lease_ms: int,
                 max_attempts: int, stall_timeout_s: float,
                 policy: DisaggPolicy | None = None, on_decision=None) -> None:
        self.pool = pool
        self.records = RequestRecords(store)
        self.attempts = Attempts(pool, self.records, transport, lease_ms, stall_timeout_s,
                                 policy, on_decision)
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
        seqs = fork(request_id, prompt, params, trace.set_span_in_context(span))
        self._active[request_id] = seqs
        merged: FanIn | None = None
        final, error = State.FINISHED, None
        try:
            # NOTE: inside the try: a client gone while the record is being
            # opened must still have it closed (ABORTED), not left QUEUED.
            await self.records.open(request_id, prompt, params, seqs)
            merged = FanIn([self._sequence(s) for s in seqs])
            async for _, chunk in merged:
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            final = State.ABORTED
            raise
        except BaseException as exc:
            final, error = State.FAILED, exc
            raise
        finally:
            span.set_attribute("state", final.value)
            end_span(span, error)
            self._active.pop(request_id, None)
            if merged is not None:
                merged.cancel()
            # NOTE: wound up in a task of its own. Starlette cancels a
            # disconnected client's stream with an anyio cancel scope, which
            # cancels every await made here again: awaited in place, the final
            # state (ABORTED) was never written.
            wind_up = asyncio.ensure_future(self._wind_up(merged, request_id, seqs, final))
            self._winding_up.add(wind_up)
            wind_up.add_done_callback(self._winding_up.discard)
            await asyncio.shield(wind_up)

    async def _wind_up(self, merged: FanIn | None, request_id: str, seqs: list[Sequence],
                       final: State) -> None:
        if merged is not None:
            await merged.aclose()
        await self.records.close(request_id, seqs, final)

    async def _sequence(self, seq: Sequence) -> AsyncIterator[Chunk]:
        """One sequence's chunks; whatever way it ends, no worker keeps its blocks."""
        request_id_var.set(seq.record_id or seq.request_id)  # its task's log lines
        try:
            async for chunk in self._run(seq):
                yield chunk
            seq.outcome = State.FINISHED
        except asyncio.CancelledError:
            seq.outcome = State.ABORTED
            await asyncio.shield(self.attempts.abort_everywhere(seq))
            raise
        except BaseException:
            seq.outcome = State.FAILED
            await asyncio.shield(self.attempts.abort_everywhere(seq))
            raise

    async def _run(self, seq: Sequence) -> AsyncIterator[Chunk]:
        """One sequence, retried (before its first token) or migrated (after)
        until it finishes or ``max_attempts`` attempts have failed."""
        tried: set[str] = set()
        last_error: Exception | None = None
        while seq.attempt < self.max_attempts:
            seq.attempt += 1
            if seq.aborted:
                break
            try:
                async for chunk in self.attempts.run(seq, tried):
                    yield chunk
                return
            except (Overloaded, NoWorkerAvailable) as err:
                if not seq.sent:
                    raise  # no room (429) or no decode worker at all (503)
                last_error = StreamFailed(f"cannot continue the request: {err}")
            except AttemptFailed as err:
                if not seq.aborted:
                    logger.warning("%s attempt %d failed (%s); %s", seq.request_id, seq.attempt,
                                   err, "migrating" if seq.sent else "retrying")
                last_error = err
            await self.attempts.abort_everywhere(seq)
            if not seq.sent and not seq.aborted and seq.attempt < self.max_attempts:
                # A retry on the same workers a moment later, not at once: a
                # failure that passes (a transfer that found the peer busy)
                # has time to. A stream that moves does not wait: its client does.
                await asyncio.sleep(RETRY_BACKOFF_S * seq.attempt)
        if seq.aborted:
            yield seq.abort_chunk()
            return
        raise _gave_up(seq, last_error)

    async def abort(self, request_id: str) -> bool:
        """Abort by id from outside the request's own stream (all workers).
        Returns whether this gateway is running the request."""
        seqs = self._active.get(request_id)
        for seq in seqs or ():
            seq.aborted = True
        # With n > 1 the workers know the sequences ("{id}#{i}"), not the request.
        ids = [s.request_id for s in seqs] if seqs else [request_id]
        addresses = [w.address for w in self.pool.workers.values() if w.healthy]
        await asyncio.gather(*(
            self.pool.stub(a).Abort(worker_pb2.AbortRequest(request_id=rid), timeout=5.0)
            for a in addresses for rid in ids
        ), return_exceptions=True)
        return seqs is not None


def _gave_up(seq: Sequence, last_error: Exception | None) -> Exception:
    """What the client is told when every attempt at ``seq`` failed."""
    if seq.sent:
        return StreamFailed(f"request failed after {len(seq.sent)} tokens: {last_error}")
    if isinstance(last_error, AttemptFailed):
        if last_error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return Overloaded(last_error.details)
        # NOTE: not the worker's own status: a worker's NOT_FOUND or
        # UNAVAILABLE would reach the client as "model not found" or
        # "draining"; what failed is the cluster behind the gateway.
        return StreamFailed(f"no worker could serve the request after {seq.attempt} "
                            f"attempts: {last_error}")
    return last_error or Overloaded("no worker could take the request")
