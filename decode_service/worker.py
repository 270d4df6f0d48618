"""The decode worker: reserves blocks, receives prompt KV, runs continuous
batching over requests whose KV arrived, streams tokens.

With role "both" it also runs whole requests itself (the colocated
baseline): a Decode call without a first token is an ordinary request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from opentelemetry import context as otel_context

from engine.async_engine import AsyncEngineLoop
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from kv_transfer.receiver import KVReceiver
from rpc.convert import logprobs_from_proto, params_from_proto
from rpc.errors import Draining, Fenced, NotFound, Overloaded
from rpc.lease import DEFAULT_LEASE_MS
from rpc.protos import worker_pb2
from rpc.tracing import end_span, tracer
from worker.base import WorkerBase
from worker.outputs import prompt_logprobs_to_proto, to_chunk

logger = logging.getLogger("decode")
_tracer = tracer("tandem.decode")

# How long KV that has fully arrived waits for its Decode call, past the lease.
CLAIM_GRACE_S = 30.0


class DecodeWorker(WorkerBase):
    def __init__(self, aengine: AsyncEngineLoop, worker_id: str, address: str,
                 role: str = "decode", **kwargs) -> None:
        self.role = role
        super().__init__(aengine, worker_id, address, **kwargs)
        self.receiver = KVReceiver(self.io, self.layout, release=self._free_reservation_soon)
        self.receiver.on_transfer.append(
            lambda t, n, s, ok: self.metrics.observe_transfer(t, "recv", n, s, ok)
        )
        self.leases: dict[str, float] = {}  # request id -> monotonic expiry
        # Reservations being made -> whether an Abort came meanwhile.
        self._reserving: dict[str, bool] = {}
        self._reaper: asyncio.Task | None = None

    def transports(self) -> list[str]:
        names = ["grpc", "torch"] if self.torch_allowed else ["grpc"]
        if self.kv_transports.mooncake is not None:
            names.append("mooncake")
        return names

    # ---- reservations -------------------------------------------------------------

    async def reserve(self, req: worker_pb2.ReserveRequest) -> worker_pb2.Ticket:
        self.check_accepting()
        self._start_reaper()
        params = params_from_proto(req.params)
        if params.n != 1:
            raise ValueError("a reservation is for one sequence (n=1); the gateway fans out n")
        tokens = list(req.prompt_token_ids)
        request_id = req.request_id

        def op(engine: LLMEngine) -> list[int] | None:
            return engine.reserve_remote(request_id, tokens, params)

        if request_id in self._reserving:
            raise ValueError(f"request id {request_id!r} is already in use")
        # NOTE: the reservation may wait for the engine thread; until this
        # coroutine registers its lease, an Abort or a cancelled call would
        # leave its blocks held by nobody. Both are caught here and the
        # blocks freed.
        self._reserving[request_id] = False
        try:
            run = (self.aengine.run_concurrently if self.engine.reserves_during_forward
                   else self.aengine.run)
            block_ids = await run(op)
        except asyncio.CancelledError:
            asyncio.ensure_future(self.aengine.abort(request_id))  # after the op, if it lands
            raise
        finally:
            aborted = self._reserving.pop(request_id)
        if aborted:
            # The Abort's own engine call runs after the reservation and frees it.
            raise NotFound(f"request {request_id!r} was aborted while its blocks were reserved")
        if block_ids is None:
            raise Overloaded(
                f"no room for {len(tokens)} prompt tokens "
                f"({self.engine.stats().num_free_blocks} blocks free)"
            )
        lease_ms = req.lease_ms or DEFAULT_LEASE_MS
        self.leases[request_id] = time.monotonic() + lease_ms / 1000
        self.receiver.expect(request_id, block_ids, req.attempt)
        self.metrics.reservations_held.set(len(self.leases))
        mooncake = self.kv_transports.mooncake
        return worker_pb2.Ticket(
            request_id=request_id, decode_worker_id=self.worker_id, decode_address=self.address,
            block_ids=block_ids, lease_expiry_unix_ms=int((time.time() * 1000) + lease_ms),
            attempt=req.attempt, layout=self.layout.to_proto(),
            mooncake=None if mooncake is None else mooncake.target(),
        )

    async def receive_grpc(self, chunks) -> int:
        with _tracer.start_as_current_span("kv_transfer.receive",
                                           attributes={"transport": "grpc"}) as span:
            received = await self.receiver.receive_grpc(chunks)
            span.set_attribute("bytes", received)
            return received

    async def open_group(self, req: worker_pb2.OpenTransferGroupRequest) -> None:
        self.check_torch_allowed()
        # Before joining (connecting to) the store: it must be a known prefill worker's.
        await self.peers.check_store(req.prefill_worker_id, req.store_address)
        await self.receiver.open_group(req)

    async def receive_preflight(self, chunks) -> int:
        return await self.receiver.receive_preflight(chunks)

    async def receive_frames(self, frames) -> None:
        self.check_torch_allowed()
        await self.receiver.receive_frames(frames)

    async def receive_writes(self, messages):
        """A mooncake or torch transfer's control stream."""
        # Not made current: a context held across a yield would leak.
        span = _tracer.start_span("kv_transfer.receive", context=otel_context.get_current())

        def allowed(transport: str) -> None:
            span.set_attribute("transport", transport)
            if transport == "torch":
                self.check_torch_allowed()
            elif self.kv_transports.mooncake is None:
                raise self._unimplemented("WriteKV (this worker runs no mooncake transfer "
                                          "engine)")

        error = None
        try:
            async for reply in self.receiver.receive_writes(messages, allowed):
                if reply.bytes_received:
                    span.set_attribute("bytes", reply.bytes_received)
                yield reply
        except BaseException as exc:
            error = exc
            raise
        finally:
            end_span(span, None if isinstance(error, GeneratorExit) else error)

    # ---- decoding -------------------------------------------------------------------

    async def decode(self, req: worker_pb2.DecodeRequest) -> AsyncIterator[worker_pb2.DecodeChunk]:
        request_id = req.request_id
        if req.HasField("first_token_id"):
            add = self._continue_reserved(req)
        else:
            self.check_accepting()
            if self.role != "both" and not req.output_token_ids and not req.local_prefill:
                raise ValueError(
                    f"decode worker {self.worker_id} needs a reservation with the prompt's KV; "
                    "only a 'both' worker runs prompts itself"
                )
            add = self._start_local(req)
        start = time.monotonic()
        last: float | None = None
        # A child of the call's server span. Not made current: this is an
        # async generator, and a context held across a yield would leak.
        span = _tracer.start_span("decode.generate", context=otel_context.get_current(),
                                  attributes={"request_id": request_id,
                                              "reserved": req.HasField("first_token_id")})
        steps, error = 0, None
        # Closed in `finally`: a cancelled call aborts the request now, not
        # whenever the generator is garbage collected.
        outs = self.aengine.stream(request_id, add)
        held = self.hold(request_id)
        try:
            first = True
            async for out in outs:
                comp = out.outputs[0]
                now = time.monotonic()
                if comp.delta_token_ids:
                    steps += 1
                    if last is None:
                        span.set_attribute("queue_s", now - start)
                    if last is None:
                        self.metrics.ttft.observe(now - start)
                    else:
                        self.metrics.itl.observe((now - last) / len(comp.delta_token_ids))
                    last = now
                if comp.finish_reason == "abort" and request_id in self.evicted:
                    raise Draining(f"worker {self.worker_id} shut down before {request_id!r} "
                                   "finished; continue it on another worker")
                chunk = to_chunk(out, comp)
                if first:
                    chunk.prompt_logprobs.extend(prompt_logprobs_to_proto(out))
                if not (chunk.token_ids or chunk.text or chunk.finish_reason
                        or chunk.prompt_logprobs):
                    continue  # the start of a request whose first token was sent already
                first = False
                if comp.finished():
                    self.metrics.observe_finished(len(out.prompt_token_ids),
                                                  len(comp.token_ids), comp.finish_reason or "",
                                                  now - start)
                yield chunk
        except BaseException as exc:
            error = exc
            raise
        finally:
            span.set_attributes({"steps": steps, "tokens": len(comp.token_ids) if steps else 0})
            end_span(span, None if isinstance(error, GeneratorExit) else error)
            self.release(request_id, held)
            await outs.aclose()

    def _continue_reserved(self, req: worker_pb2.DecodeRequest):
        request_id = req.request_id
        if not self.receiver.is_complete(request_id):
            if request_id not in self.receiver.reservations:
                raise NotFound(f"unknown request {request_id!r} (never reserved, expired or "
                               "aborted)")
            raise NotFound(f"the KV of {request_id!r} has not arrived")
        if self.receiver.reservations[request_id].attempt != req.attempt:
            raise Fenced(f"decode for attempt {req.attempt} of {request_id!r}")
        self.receiver.forget(request_id)
        self.leases.pop(request_id, None)
        self.metrics.reservations_held.set(len(self.leases))
        first = req.first_token_id
        first_lp = logprobs_from_proto(req.first_logprobs) if req.HasField("first_logprobs") \
            else None
        sent = req.first_token_sent  # the gateway sent it from the prefill's reply

        def add(engine: LLMEngine) -> list[RequestOutput]:
            try:
                return engine.start_remote(request_id, first, first_lp, first_token_sent=sent)
            except KeyError:
                raise NotFound(f"request {request_id!r} is no longer reserved") from None

        return add

    def _start_local(self, req: worker_pb2.DecodeRequest):
        """A whole request on this worker: colocated, or a migration that
        recomputes prompt + tokens already sent."""
        params = params_from_proto(req.params)
        if params.n != 1:
            raise ValueError("Decode serves one sequence (n=1); the gateway fans out n")
        prompt = list(req.prompt_token_ids)
        already = list(req.output_token_ids)
        request_id = req.request_id

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, output_token_ids=already)

        return add

    # ---- leases and aborts ------------------------------------------------------------

    def held(self) -> list[str]:
        # NOTE: a reservation counts: its prefill is running and its Decode
        # call follows (it is taken while draining), so the drain waits for it.
        return [*self.inflight, *(r for r in self.leases if r not in self.inflight)]

    async def abort(self, request_id: str) -> bool:
        if request_id in self._reserving:
            self._reserving[request_id] = True
        if self.leases.pop(request_id, None) is not None:
            self.metrics.reservations_held.set(len(self.leases))
        if not self.receiver.cancel(request_id):
            return True  # a transfer is writing the blocks: freed when it stops
        return await super().abort(request_id)

    def _free_reservation_soon(self, request_id: str) -> None:
        asyncio.ensure_future(self.aengine.abort(request_id))

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap_leases())

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for request_id, expiry in list(self.leases.items()):
                r = self.receiver.reservations.get(request_id)
                if r is not None and r.writing:
                    continue  # KV is arriving: the request is alive
                if r is not None and r.completed_at is not None:
                    # The KV is here: the gateway's Decode call should follow at
                    # once; if it never does (the gateway died), free the blocks.
                    expiry = max(expiry, r.completed_at + CLAIM_GRACE_S)
                if expiry <= now:
                    logger.info("lease of %s expired: freeing its blocks", request_id)
                    self.metrics.reservations_expired.inc()
                    await self.abort(request_id)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await super().close()
