"""What the REST and gRPC front ends share: the model's tokenizer and limits,
admission control, the worker pool, request state and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace

from engine.config import ModelConfig
from engine.generation_config import sampling_defaults
from engine.loader.resolve import model_fingerprint, resolve_model_dir
from engine.prompts import context_room
from engine.request_checks import check_request
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatOptions, Tokenizer
from gateway.auth import ApiKeys
from gateway.config import GatewayConfig
from gateway.disagg_policy import DisaggPolicy
from gateway.fallback_store import FallbackStore
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.router import WorkerPool
from gateway.sequence import Chunk
from gateway.state import make_store
from gateway.structured import InvalidField
from gateway.worker_gauges import WorkerGauges
from rpc.errors import Draining, NotFound, Overloaded
from rpc.pool import ChannelPool
from rpc.tracing import tracer

_tracer = tracer("tandem.gateway")

logger = logging.getLogger("gateway")
T = TypeVar("T")


class ModelNotFound(NotFound):
    pass


class GatewayService:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        model_dir = resolve_model_dir(config.model)
        self.tokenizer = Tokenizer(model_dir)
        self.model_config = ModelConfig.from_dir(model_dir)
        # What a request leaves unset is sampled as the model's
        # generation_config.json says.
        self.sampling_defaults = sampling_defaults(model_dir, config.generation_config)
        self.model_name = config.served_model_name or default_model_name(config.model)
        limit = self.model_config.max_model_len
        self._max_model_len = min(config.max_model_len or limit, limit)
        self.channels = ChannelPool(config.tls)
        self.pool = WorkerPool(self.channels, model_fingerprint(model_dir),
                               static=[*config.prefill, *config.decode],
                               registry_url=config.state_url)
        self.metrics = GatewayMetrics()
        self.metrics.registry.register(WorkerGauges(self.pool))
        self.store = make_store(config.state_url, config.finished_ttl_s)
        if config.state_url:  # Redis: generation goes on without it (fallback_store.py)
            self.store = FallbackStore(self.store, config.finished_ttl_s,
                                       on_change=self.metrics.state_store_up.set)
        self.metrics.state_store_up.set(1)
        policy = DisaggPolicy(config.disagg_policy, config.disagg_min_remote_tokens)
        self.orchestrator = Orchestrator(
            self.pool, self.store, config.transport, config.lease_ms, config.max_attempts,
            config.stall_timeout_s, policy,
            on_decision=lambda d: self.metrics.disagg_decisions.labels(
                policy.policy, "remote" if d.remote else "local").inc())
        self.active = 0
        self.draining = False
        self.created = int(time.time())
        self._cpu = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self.keys = ApiKeys(config.api_key, config.api_key_file)

    @property
    def max_model_len(self) -> int:
        """The longest sequence served: the model's (or ``--max-model-len``),
        or fewer tokens where that is all the largest decode worker's whole
        KV cache holds (its engine serves no more)."""
        cache = self.pool.largest_decode_cache
        return min(self._max_model_len, cache) if cache else self._max_model_len

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        await self.store.close()
        await self.channels.close()
        self._cpu.shutdown(wait=False, cancel_futures=True)

    async def drain(self) -> None:
        """Refuse new requests (503 / UNAVAILABLE); wait for active ones."""
        self.draining = True
        deadline = time.monotonic() + self.config.drain_grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # ---- validation ---------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name and name != self.model_name:
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves "
                                f"`{self.model_name}`")

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize_text(prompt)
        return list(prompt)  # checked against the vocabulary by check_request

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise ValueError("prompt must not be empty")
        self._check_chars(len(text))
        self._check_prefixes(text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    def tokenize_chat(self, messages: list[dict], options: ChatOptions,
                      tools: list[dict] | None = None) -> list[int]:
        """The prompt of a conversation: rendered by the chat template, then
        checked as a text prompt is (the template may add tools and
        variables to the messages' text) and tokenized."""
        self._check_chars(sum(len(m.get("content") or "") for m in messages))
        text = self.tokenizer.apply_chat_template(
            messages, options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **options.variables_with(tools))
        self._check_chars(len(text))
        self._check_prefixes(text, add_special_tokens=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _check_chars(self, chars: int) -> None:
        """ValueError for a text far too long for the context, before the
        time (seconds for megabytes) of tokenizing it is spent."""
        # NOTE: 4x the bound (tokenizer.max_token_chars) for normalizers that
        # shorten a text before it is split.
        most = 4 * self.max_model_len * self.tokenizer.max_token_chars
        if chars > most:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} "
                             f"tokens (max_model_len); the prompt has {chars} characters, far "
                             f"more than that many tokens hold")

    def _check_prefixes(self, text: str, add_special_tokens: bool) -> None:
        """ValueError when a prefix of a long text already has twice the
        context's tokens: two 8 MB prompts of CJK text (a token or more a
        character) took both tokenizer threads for 15 s each before. The
        prefixes grow 4x at a time, so a text that fits costs at most a
        third more. (Twice: a cut may split a word's tokens differently.)"""
        size = 4 * self.max_model_len
        while size < len(text):
            tokens = len(self.tokenizer.encode(text[:size], add_special_tokens))
            if tokens > 2 * self.max_model_len:
                raise ValueError(f"This model's maximum context length is {self.max_model_len} "
                                 f"tokens (max_model_len); the prompt's first {size} characters "
                                 f"already have {tokens} tokens")
            size *= 4

    def default_max_tokens(self, prompt: list[int]) -> int:
        """A request's max_tokens when it sends none: the room left in the
        context, or the model's ``max_new_tokens`` if less."""
        room = context_room(len(prompt), self.max_model_len)
        return min(room, self.sampling_defaults.get("max_tokens") or room)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` (tokenizing, chat templating) on the tokenizer
        threads: a 10 MB prompt must not stall every other request's stream."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def check_chat(self, messages: int, tools: int = 0) -> None:
        """ValueError for more chat messages than ``--max-messages``, or more
        tools than ``--max-tools``."""
        if messages > self.config.max_messages:
            raise InvalidField("messages", f"at most {self.config.max_messages} messages are "
                                           f"allowed, got {messages}")
        if tools > self.config.max_tools:
            raise InvalidField("tools", f"at most {self.config.max_tools} tools are allowed, "
                                        f"got {tools}")

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """ValueError (a 400) for a request over a limit or the context: the
        engine's own check (engine/request_checks.py), then the gateway's limits."""
        cfg = self.config
        check_request(prompt, params, self.model_config, self.max_model_len, cfg.max_n)
        num_stop = len(params.stop) + len(params.stop_token_ids)
        if num_stop > cfg.max_stop:
            raise ValueError(f"at most {cfg.max_stop} stop strings and stop token ids are "
                             f"allowed, got {num_stop}")
        if any(len(s) > cfg.max_stop_chars for s in params.stop):
            raise ValueError(f"a stop string may have at most {cfg.max_stop_chars} characters")
        words = params.bad_words or []
        if len(words) > cfg.max_bad_words:
            raise ValueError(f"at most {cfg.max_bad_words} bad_words are allowed, got {len(words)}")
        if any(len(w) > cfg.max_stop_chars for w in words):
            raise ValueError(f"a bad word may have at most {cfg.max_stop_chars} characters")
        if len(params.logit_bias or ()) > cfg.max_logit_bias:
            raise ValueError(f"at most {cfg.max_logit_bias} logit_bias entries are allowed, "
                             f"got {len(params.logit_bias)}")

    # ---- generation ---------------------------------------------------------------------

    def admit(self, prompts: int = 1) -> Admission:
        """Places for a request's prompts in ``--max-active-requests``, all
        or none: Draining (503) or Overloaded (429, counted once in
        ``requests_rejected``) when they are not all free now."""
        if self.draining:
            raise Draining("the server is shutting down")
        if self.active + prompts > self.config.max_active_requests:
            self.metrics.rejected.inc()
            raise Overloaded(f"{self.active} requests in progress; try again shortly")
        self.active += prompts
        return Admission(self, prompts)

    async def generate(self, prompt: list[int], params: SamplingParams,
                       request_id: str | None = None,
                       trace_parent: otel_context.Context | None = None,
                       admission: Admission | None = None,
                       ) -> AsyncIterator[Chunk]:
        """Admitted, measured generation of a prompt and parameters the
        caller has checked (``check_request``). Admitted here unless the
        caller's ``admission`` holds a place for it; raises Draining (503) or
        Overloaded (429) before the first chunk then."""
        (admission or self.admit()).take()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        self.metrics.waiting.inc()
        start = time.monotonic()
        last: float | None = None
        first_at: float | None = None
        counts: dict[int, int] = {}
        reasons: dict[int, str] = {}
        finished_ok = False
        try:
            async for chunk in self.orchestrator.generate(request_id, prompt, params,
                                                          trace_parent):
                now = time.monotonic()
                if chunk.token_ids:
                    if last is None:
                        first_at = now
                        self.metrics.ttft.observe(now - start)
                        self.metrics.waiting.dec()
                        self.metrics.running.inc()
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                    counts[chunk.index] = counts.get(chunk.index, 0) + len(chunk.token_ids)
                if chunk.finish_reason:
                    reasons[chunk.index] = chunk.finish_reason
                yield chunk
            finished_ok = True
        finally:
            self.active -= 1
            (self.metrics.waiting if first_at is None else self.metrics.running).dec()
            e2e = time.monotonic() - start
            if finished_ok:
                self.metrics.e2e.observe(e2e)
                self.metrics.prompt_tokens.observe(len(prompt))
                for index, reason in reasons.items():
                    self.metrics.generation_tokens.observe(counts.get(index, 0))
                    self.metrics.success.labels(reason).inc()
            logger.info(
                "request %s %s: %d prompt tokens, %d generated, %.3fs",
                request_id, "finished" if finished_ok else "ended early", len(prompt),
                sum(counts.values()), e2e,
                extra={"request_id": request_id, "trace_id": _trace_id(trace_parent),
                       "timings": {"e2e_s": round(e2e, 4), "ttft_s": None if first_at is None
                                   else round(first_at - start, 4)}},
            )


def request_span(name: str, parent: otel_context.Context | None) -> trace.Span:
    """The root span of one API call (a child of the caller's traceparent)."""
    return _tracer.start_span(name, context=parent)


def _trace_id(ctx: otel_context.Context | None) -> str | None:
    span_ctx = trace.get_current_span(ctx).get_span_context()
    return format(span_ctx.trace_id, "032x") if span_ctx.is_valid else None


def default_model_name(model: str | None) -> str:
    """The name a gateway serves ``model`` under when not told otherwise."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


class Admission:
    """Places a request holds in ``--max-active-requests``: each prompt's
    generation takes one and gives it back when it ends; ``close`` gives
    back those never taken (a batch that failed before all of its prompts
    started)."""

    def __init__(self, service: GatewayService, places: int) -> None:
        self.service = service
        self.untaken = places

    def take(self) -> None:
        self.untaken -= 1

    def close(self) -> None:
        self.service.active -= self.untaken
        self.untaken = 0
