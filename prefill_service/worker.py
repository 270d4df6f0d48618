"""The prefill worker: runs prompts (batched, chunked, prefix-cached) into its
own paged cache, pushes each prompt's KV into the blocks its ticket names on
a decode worker, and answers with the first sampled token once the decode
side has acknowledged the KV. Its blocks are freed right after."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from engine.async_engine import AsyncEngineLoop
from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import LLMEngine
from kv_transfer.base import KVSender
from kv_transfer.grpc_transport import GrpcSender
from kv_transfer.layout import KVLayout
from kv_transfer.mooncake_transport import MooncakeSender
from kv_transfer.progress import PrefillProgress, PromptDone
from kv_transfer.torch_transport import TorchSender
from rpc.convert import logprobs_to_proto, params_from_proto, set_stop_reason
from rpc.errors import Fenced
from rpc.pool import ChannelPool
from rpc.protos import worker_pb2
from rpc.tracing import current, end_span, tracer
from worker.base import WorkerBase

logger = logging.getLogger("prefill")
_tracer = tracer("tandem.prefill")


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, aengine: AsyncEngineLoop, worker_id: str, address: str,
                 host: str = "127.0.0.1", bind_host: str | None = None, **kwargs) -> None:
        """``host``: where decode workers reach this one (the torch
        transport's store); ``bind_host``: where that store listens. The
        first transport of ``transports`` that starts is the default."""
        super().__init__(aengine, worker_id, address, **kwargs)
        self.channels = ChannelPool(self.tls)
        self.senders: dict[str, KVSender] = {
            "grpc": GrpcSender(self.io, self.layout, self.channels),
            "torch": TorchSender(self.io, self.layout, self.channels, worker_id, host,
                                 bind_host),
        }
        if self.kv_transports.mooncake is not None:
            self.senders["mooncake"] = MooncakeSender(self.kv_transports.mooncake, self.layout,
                                                      self.channels, worker_id)
        self.default_transport = self.kv_transports.default
        self.layer_writes = self.kv_transports.layer_writes(self.io.device)
        for sender in self.senders.values():
            sender.on_preflight.append(
                lambda transport, peer, rate: self.metrics.peer_bandwidth.labels(
                    transport, peer).set(rate)
            )
        # Transfers in flight by request id, so that an Abort stops them.
        self.transfers: dict[str, asyncio.Task] = {}
        self._releases: set[asyncio.Task] = set()  # strong references until done

    def transports(self) -> list[str]:
        return [t for t in self.senders if t != "torch" or self.torch_allowed]

    def _sender_for(self, wanted: str, ticket: worker_pb2.Ticket) -> KVSender:
        """The sender of transport ``wanted``, or, when this worker or the
        ticket's decode worker does not run it, the next usable one (logged
        and counted: never a silent downgrade)."""
        if wanted not in ("grpc", "torch", "mooncake"):
            raise ValueError(f"unknown transport {wanted!r}; choose grpc, torch or mooncake")
        if wanted == "torch":
            self.check_torch_allowed()
            return self.senders["torch"]
        if wanted == "mooncake" and "mooncake" not in self.senders:
            wanted = self.kv_transports.fallback(
                "mooncake", "this worker has no mooncake transfer engine",
                lambda t: t != "torch" or self.torch_allowed)
        elif wanted == "mooncake" and not ticket.HasField("mooncake"):
            wanted = self.kv_transports.fallback(
                "mooncake", f"decode worker {ticket.decode_worker_id} runs no mooncake "
                "transfer engine", lambda t: t == "grpc")
        return self.senders[wanted]

    async def abort(self, request_id: str) -> bool:
        transfer = self.transfers.get(request_id)
        if transfer is not None:
            transfer.cancel()  # the sender returns once the source blocks are free to go
        return await super().abort(request_id)

    async def prefill(self, req: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        self.check_accepting()
        ticket = req.ticket
        # Before anything connects: the ticket's decode worker must be one we know.
        await self.peers.check_decode(ticket.decode_worker_id, ticket.decode_address)
        self.layout.check_compatible(KVLayout.from_proto(ticket.layout),
                                     f"decode worker {ticket.decode_worker_id}")
        if ticket.lease_expiry_unix_ms and ticket.lease_expiry_unix_ms < time.time() * 1000:
            raise Fenced(f"the reservation of {req.request_id!r} has expired")
        sender = self._sender_for(req.transport or self.default_transport, ticket)
        params = params_from_proto(req.params)
        if params.n != 1:
            raise ValueError("a prefill is for one sequence (n=1); the gateway fans out n")
        tokens = list(req.prompt_token_ids)
        self.engine.validate(tokens, params)
        needed = self.engine.num_blocks_for(len(tokens))
        if needed != len(ticket.block_ids):
            raise ValueError(f"the ticket has {len(ticket.block_ids)} blocks, the prompt "
                             f"needs {needed}")
        # Sample only the first token here; the decode worker does the rest.
        # The request's own stop strings, stop tokens and EOS handling stay:
        # they say whether that token already ends the request, exactly as
        # the decode worker would have found.
        first_params = dataclasses.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1),
        )
        request_id = req.request_id
        if request_id in self.inflight:
            # NOTE: checked here, not left to the engine: the cleanup below
            # would free the blocks of the other request that holds this id.
            raise ValueError(f"request id {request_id!r} is already in use")

        sink = None  # the engine sink of a sender by layer: each layer, or the prompt's end

        def add(engine: LLMEngine) -> None:
            # Its blocks are held until the decode worker has the KV.
            engine.add_request(request_id, tokens, first_params, hold_blocks=True)
            if sink is not None:
                engine.stream_layers(request_id, sink)

        held = self.hold(request_id)
        computed = False
        transfer: asyncio.Future | None = None
        watch = None
        # Mooncake and torch open their transfer now, and send by layer or as
        # soon as the forward pass that completes the prompt is over.
        try:
            if sender.sends_by_layer:

                def by_layer(span):
                    nonlocal sink
                    sink = sender.layer_sink(request_id, ticket, span)
                    return sender.send_layers(request_id, ticket, sink)

                def at_end(_):
                    nonlocal sink
                    sink = PromptDone(asyncio.get_running_loop(), self.io.device,
                                      len(ticket.block_ids))
                    return sender.send_when(request_id, ticket, sink.blocks)

                send_span, transfer = self._start_send(
                    sender, ticket, by_layer if self.layer_writes else at_end)
                self.transfers[request_id] = transfer
            elif sender.streams_during_compute:
                # Blocks travel as chunks of the prompt finish computing.
                finished = _Held()
                progress = PrefillProgress(len(ticket.block_ids),
                                           self._reader(request_id, finished))
                watch = _watcher(self.engine, request_id, progress, finished)
                self.aengine.step_hooks.append(watch)
                send_span, transfer = self._start_send(
                    sender, ticket, lambda _: sender.send_progressive(request_id, ticket, progress))
                self.transfers[request_id] = transfer
            final, text = None, ""
            with _tracer.start_as_current_span("prefill.compute",
                                                attributes={"request_id": request_id}) as span:
                async for out in self.aengine.stream(request_id, add):
                    final = out
                    text += out.outputs[0].delta_text
                if final is not None:  # before the span ends, or it keeps none of them
                    span.set_attributes({"prompt_tokens": len(tokens),
                                         "cached_tokens": final.num_cached_tokens,
                                         "queue_s": _queue_seconds(final)})
            if final is None or final.outputs[0].finish_reason == "abort":
                raise Fenced(f"request {request_id!r} was aborted during prefill")
            computed = True
            compute_end = time.perf_counter()
            comp = final.outputs[0]
            if not comp.token_ids:
                # Structured outputs: the grammar allowed no first token. The
                # request ends here (no KV is needed: the transfer stops).
                return worker_pb2.PrefillResponse(
                    num_cached_tokens=final.num_cached_tokens,
                    finish_reason=comp.finish_reason or "grammar_dead_end")
            first_token = comp.token_ids[0]
            if transfer is None:
                done = self._finished_blocks(request_id)
                send_span, transfer = self._start_send(
                    sender, ticket, lambda _: sender.send(request_id, ticket, done))
                self.transfers[request_id] = transfer
            elif sink is None:
                progress.complete()
            try:
                stats = await transfer
                handoff = time.perf_counter() - compute_end
                send_span.set_attributes({"bytes": stats.bytes, "handoff_s": handoff})
                end_span(send_span)
            except BaseException as exc:
                end_span(send_span, exc)
                if not isinstance(exc, asyncio.CancelledError):
                    raise
                if asyncio.current_task().cancelling():
                    raise  # the call itself was cancelled
                raise Fenced(f"request {request_id!r} was aborted during the KV transfer") from None
            finally:
                self.transfers.pop(request_id, None)
            self.metrics.observe_transfer(stats.transport, "send", stats.bytes, stats.seconds,
                                          True)
        except Exception:
            if computed:  # the prompt was computed, its KV did not get across
                self.metrics.observe_transfer(sender.name, "send", 0, 0.0, False)
            raise
        finally:
            if watch is not None:
                self.aengine.step_hooks.remove(watch)
            if transfer is not None:
                if not transfer.done():
                    transfer.cancel()  # the compute failed or was aborted mid-stream
                transfer.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.release(request_id, held)
            # NOTE: not awaited: the answer (the first token) would wait for
            # the step running now, seconds on a CPU under a backlog.
            self._release_soon(request_id)
        resp = worker_pb2.PrefillResponse(
            first_token_id=first_token, num_cached_tokens=final.num_cached_tokens,
            kv_bytes=stats.bytes, transfer_seconds=handoff,
        )
        if comp.finish_reason == "stop" or params.max_tokens == 1:
            # The first token ends the request (EOS, a stop token or string,
            # max_tokens): the engine's last output is the whole completion.
            resp.text, resp.finish_reason = text, comp.finish_reason
            set_stop_reason(resp, comp.stop_reason)
        else:
            # Only the max_tokens=1 of this prefill ended it: the engine's
            # final output flushed what a stream that goes on holds back.
            resp.text = self._streamed_text(tokens, params, first_token)
        if comp.logprobs:
            resp.first_logprobs.CopyFrom(logprobs_to_proto(first_token, comp.logprobs[0]))
        if final.prompt_logprobs is not None:
            resp.prompt_logprobs.extend(
                logprobs_to_proto(t, lp)
                for t, lp in zip(final.prompt_token_ids[1:], final.prompt_logprobs[1:])
            )
        return resp

    def _streamed_text(self, prompt: list[int], params, token: int) -> str:
        """The text of the first output token ``token`` as the decode
        worker's stream would send it, were the token its own: short of a
        partial character or a possible stop-string prefix, which the decode
        worker sends with the tokens that complete them."""
        if self.engine.tokenizer is None:
            return ""
        detok = IncrementalDetokenizer(self.engine.tokenizer, prompt, params.stop,
                                       params.include_stop_str_in_output,
                                       params.skip_special_tokens)
        detok.add(token)
        return detok.take(final=False)

    def _start_send(self, sender: KVSender, ticket: worker_pb2.Ticket, start):
        """The transfer task ``start(span)``, under a span of its own: the
        task copies the current context, so its calls to the decode worker
        carry the span."""
        span = _tracer.start_span("kv_transfer.send", attributes={
            "transport": sender.name, "peer": ticket.decode_worker_id,
            "blocks": len(ticket.block_ids), "request_id": ticket.request_id,
        })
        try:
            coro = start(span)
        except BaseException as exc:
            end_span(span, exc)
            raise
        with current(span):
            return span, asyncio.ensure_future(coro)

    def _finished_blocks(self, request_id: str) -> list[int]:
        """The block ids of a prompt whose compute is over (on the event
        loop: held until released, they no longer change)."""
        done = self.engine.kv_progress(request_id)
        if done is None:
            raise Fenced(f"request {request_id!r} was aborted during prefill")
        return done.block_ids

    def _release_soon(self, request_id: str) -> None:
        """Free the request's blocks here at the engine's next turn."""
        task = asyncio.ensure_future(self.aengine.run(lambda e: e.release(request_id)))
        self._releases.add(task)

        def done(t: asyncio.Task) -> None:
            self._releases.discard(t)
            if not t.cancelled() and t.exception() is not None:
                logger.error("releasing the blocks of %s failed", request_id,
                             exc_info=t.exception())

        task.add_done_callback(done)

    def _reader(self, request_id: str, held: _Held):
        """Reads blocks of the request: on the engine thread between two
        steps while the prompt computes (a step may preempt it and hand its
        blocks to another), directly once it is done (``held``: its blocks
        are held until released, and no step writes them)."""

        async def read(lo: int, hi: int):
            if held.block_ids is not None:
                # Off the event loop: with tensor parallelism a read waits
                # for the running step and gathers from every rank.
                return await asyncio.get_running_loop().run_in_executor(
                    None, self.io.read, held.block_ids[lo:hi])

            def op(engine: LLMEngine):
                progress = engine.kv_progress(request_id)
                if progress is None:
                    # Not None ("not yet"): the sender would ask again forever.
                    raise Fenced(f"request {request_id!r} was aborted")
                if hi > progress.num_computed_blocks:
                    return None  # preempted since: recomputing
                return self.io.read(progress.block_ids[lo:hi])

            return await self.aengine.run(op)

        return read

    async def close(self) -> None:
        for sender in self.senders.values():
            await sender.close()
        await self.channels.close()
        await super().close()  # the mooncake endpoint goes with the worker's transports


class _Held:
    """The block ids of a prompt that finished computing; None before."""

    block_ids: list[int] | None = None


def _watcher(engine: LLMEngine, request_id: str, progress: PrefillProgress, held: _Held):
    """A step hook that publishes how many of the request's blocks are done."""

    def watch(_outputs) -> None:
        state = engine.kv_progress(request_id)
        if state is None:
            return
        if state.finished:
            held.block_ids = state.block_ids
            progress.complete()
        else:
            progress.update(state.num_computed_blocks)

    return watch


def _queue_seconds(out) -> float:
    scheduled = out.metrics.get("first_scheduled_time")
    return 0.0 if scheduled is None else scheduled - out.metrics["arrival_time"]
