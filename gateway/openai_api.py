"""OpenAI-compatible REST: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics, with server-sent events for ``stream: true``.

Every error is an OpenAI error object with the matching status. An error
after a stream has begun is sent as an error event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from gateway.fan_in import FanIn
from gateway.openai_errors import error_response, validation_message
from gateway.openai_render import ChatRenderer, CompletionRenderer
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.request_guard import RequestGuard, error_body
from gateway.sequence import Chunk
from gateway.service import GatewayService, request_span
from gateway.structured import InvalidField, build, constraint_of
from gateway.tool_parsers import Named, Required, make_parser
from gateway.tools import chat_messages, parse_tool_choice, parse_tools, tool_constraint
from gateway.vllm_routes import TANDEM_VERSION, add_vllm_routes
from rpc.errors import TandemError
from rpc.tracing import context_from_headers, end_span, tracer

logger = logging.getLogger("gateway")

_tracer = tracer("tandem.gateway")


def build_app(service: GatewayService) -> FastAPI:
    app = FastAPI(title="Tandem", version=TANDEM_VERSION)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", None, param), 400)

    async def _known(request: Request, exc: Exception):
        return error_response(exc)

    # NOTE: the expected errors get their own handlers. A handler for
    # Exception alone runs in Starlette's ServerErrorMiddleware, which sends
    # the response and then re-raises: uvicorn logs a traceback for every 400
    # and drops the connection, so clients saw "connection reset" instead.
    for cls in (ValueError, TandemError):
        app.add_exception_handler(cls, _known)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # The router's own answers (no such path, a method the path does not
        # take, a body that will not parse) as OpenAI error objects too.
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"),
                            exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):  # nobody reads it: nginx's 499
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):  # unexpected: 500, and logged
        return error_response(exc)

    app.add_middleware(RequestGuard, check_key=service.keys.check,
                       max_body_bytes=service.config.max_body_bytes)
    origins = [o.strip() for o in service.config.allowed_origins.split(",") if o.strip()]
    if origins:
        # NOTE: added last, so outermost: a browser's preflight carries no API
        # key, and a 401 or 413 must carry the headers for the page to read it.
        # No credentials: callers authenticate with keys, not cookies.
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"])

    @app.get("/health")
    async def health(request: Request):
        if service.draining:
            return JSONResponse({"status": "draining"}, 503)
        # Liveness for anyone; where the workers are only for a key holder.
        if service.keys.check(request.headers.get("authorization")) is None:
            return {"status": "ok"}
        return {"status": "ok", "workers": service.pool.snapshot()}

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    add_vllm_routes(app, service)

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": service.created,
                "owned_by": "tandem", "max_model_len": service.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        service.check_model(model)  # ModelNotFound: the OpenAI 404 error object
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _traced("POST /v1/completions", request, _completions, body)

    async def _completions(body: CompletionRequest, span):
        service.check_model(body.model)
        if body.suffix:
            raise InvalidField("suffix", "suffix is not supported")
        if (body.best_of or 1) > 1:
            raise InvalidField("best_of", "best_of is not supported")
        prompts = _prompts(body.prompt)
        if len(prompts) > service.config.max_prompts:
            raise ValueError(f"at most {service.config.max_prompts} prompts are allowed in one "
                             f"request, got {len(prompts)}")
        with _child(span, "gateway.tokenize"):
            token_lists = [await service.off_loop(service.tokenize_prompt, p) for p in prompts]
        # Compiling a grammar can take seconds: never on the event loop.
        constraint = await service.off_loop(constraint_of, body)
        # echo with logprobs: the prompt's tokens get theirs too.
        prompt_logprobs = body.prompt_logprobs_with(body.logprobs if body.echo else None)
        # echo with max_tokens 0 answers the prompt alone (scoring it, as
        # OpenAI's legacy completions and vLLM do): one token is generated
        # for the engine's sake and left out.
        prompt_only = body.echo and body.max_tokens == 0
        params = [body.sampling(
            1 if prompt_only else body.max_tokens if body.max_tokens is not None
            else service.default_max_tokens(t),
            body.logprobs, prompt_logprobs, structured_outputs=constraint,
            defaults=service.sampling_defaults) for t in token_lists]
        for t, p in zip(token_lists, params):
            service.check_request(t, p)
        rid = f"cmpl-{uuid.uuid4().hex}"
        # NOTE: special tokens kept, as vLLM echoes token ids (Hugging Face's decode).
        echo = [p if isinstance(p, str) else await service.off_loop(service.tokenizer.decode, p,
                                                                     False)
                for p in prompts] if body.echo else None
        render = CompletionRenderer(service, rid, token_lists, params[0].n, body.logprobs or 0,
                                     body.return_token_ids, echo, body.prompt_logprobs,
                                     body.skip_special_tokens, prompt_only)
        return await _answer(render, _merge(service, rid, token_lists, params, span), body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await _traced("POST /v1/chat/completions", request, _chat, body)

    async def _chat(body: ChatCompletionRequest, span):
        service.check_model(body.model)
        if not body.messages:
            raise InvalidField("messages", "messages must be a non-empty list")
        service.check_chat(len(body.messages), len(body.tools or []))
        # Compiling the tools' and response_format's grammars can take
        # seconds: never on the event loop.
        constraint, tool_parser, names, messages, tools = await service.off_loop(
            _chat_tools, service, body)
        with _child(span, "gateway.tokenize"):
            tokens = await service.off_loop(service.tokenize_chat, messages,
                                            body.chat_options(), tools)
        # NOTE: not `or`: an explicit 0 is invalid (400), not "unset".
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)
        if body.max_completion_tokens is not None and body.max_completion_tokens < 1:
            raise InvalidField("max_completion_tokens", "max_completion_tokens must be at least "
                                                        f"1, got {body.max_completion_tokens}")
        if max_tokens is None:
            max_tokens = service.default_max_tokens(tokens)
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        params = body.sampling(max_tokens, top, body.prompt_logprobs_with(),
                               structured_outputs=constraint, defaults=service.sampling_defaults)
        service.check_request(tokens, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        render = ChatRenderer(service, rid, tokens, params.n, top or 0, tool_parser, names,
                              body.return_token_ids, body.prompt_logprobs)
        return await _answer(render, _merge(service, rid, [tokens], [params], span), body)

    return app


def _chat_tools(service: GatewayService, body: ChatCompletionRequest):
    """(output constraint, tool-call parser or None, the functions it may
    call, messages and tools for the chat template) of a chat request;
    InvalidField before any compute."""
    tools = parse_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    constraint = constraint_of(body)
    schema = tool_constraint(choice, tools, body.parallel_tool_calls is not False)
    if schema is not None:
        if constraint is not None:
            raise InvalidField("tool_choice", f"tool_choice {choice.mode!r} holds the output to "
                                              "the tools' schemas: give no response_format")
        constraint = build("tool_choice", {"json": schema})
    parser = make_parser(service.config.tool_call_parser)
    template = service.tokenizer.chat_template or ""
    messages, shown = chat_messages(body.messages, tools, choice, template, parser)
    found = {"none": None, "auto": parser, "required": Required()}.get(choice.mode) \
        if choice.mode != "named" else Named(choice.name or "")
    return constraint, found, frozenset(t.name for t in tools), messages, shown


# What a caller needs a key for (when keys are set): the API, the metrics,
# and the schema; /health answers everyone, with details for a key holder.


async def _traced(name: str, request: Request, handler, body):
    """Run ``handler(body, span)`` under the API call's root span (a child of
    the caller's traceparent); the span ends with the response stream."""
    span = request_span(name, context_from_headers(request.headers))
    try:
        return await _unless_gone(request, handler(body, span))
    except BaseException as exc:
        end_span(span, exc)
        raise


class ClientGone(Exception):
    """The client closed its connection before the answer began."""


async def _unless_gone(request: Request, work: Awaitable[Any]) -> Any:
    """``work``, cancelled as soon as the client disconnects: a non-streaming
    request, or a stream still waiting for its first token, is aborted on
    every worker then (cancelling closes its generation), not run to the end
    for nobody. Once a stream has begun, its own writer notices the client."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone("the client disconnected")
    finally:
        task.cancel()  # also when this call itself is cancelled
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection.

    NOTE: not ``request.is_disconnected()``, which only peeks and, behind
    the HTTP middleware, never sees the message: the body is read by now,
    so the next message the server sends is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _answer(render, merged: AsyncIterator, body):
    """A JSON body, or server-sent events for ``stream: true``."""
    first = await _first(merged)
    if body.stream:
        return _sse(render.stream(first, merged, body.include_usage, body.continuous_usage))
    return await render.collect(first, merged)


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt must not be empty")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _child(span, name: str):
    """A span under ``span`` around synchronous work (no await inside)."""
    return _tracer.start_as_current_span(name, context=trace.set_span_in_context(span))


async def _merge(service: GatewayService, rid: str, prompts: list[list[int]],
                 params: list, span) -> AsyncIterator[tuple[int, Chunk]]:
    """The chunks of every prompt's completions; yields (prompt index, chunk).
    Ends the request's root ``span`` when the last chunk is out."""
    ctx = trace.set_span_in_context(span)
    error: BaseException | None = None
    try:
        async for item in _merge_spanned(service, rid, prompts, params, ctx):
            yield item
    except BaseException as exc:
        error = exc
        raise
    finally:
        end_span(span, error)


async def _merge_spanned(service, rid, prompts, params, ctx):
    if len(prompts) == 1:
        async for chunk in service.generate(prompts[0], params[0], rid, ctx):
            yield 0, chunk
        return
    admission = service.admit(len(prompts))  # all prompts or none: one 429
    merged = FanIn([service.generate(p, sp, f"{rid}-p{i}", ctx, admission)
                    for i, (p, sp) in enumerate(zip(prompts, params))])
    try:
        async for item in merged:
            yield item
    finally:
        await merged.aclose()
        admission.close()


async def _first(merged: AsyncIterator) -> Any:
    """Wait for the first chunk before answering, so that errors raised
    before any token (429, 400, 503) become a status code, not a stream."""
    try:
        return await merged.__anext__()
    except StopAsyncIteration:
        return None


class _EventStream(StreamingResponse):
    """A streaming response that closes its body however the stream ends.

    When a client disconnects, Starlette cancels the streaming task. If the
    cancel lands in ``send`` (a slow reader's full socket) rather than in
    the body's wait for the next event, the body generator stays suspended
    at its ``yield``, and its request stays running until the generator is
    garbage collected. Closing it here runs its cleanup, and so the abort,
    at once."""

    async def stream_response(self, send) -> None:
        async with contextlib.aclosing(self.body_iterator):
            await super().stream_response(send)


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
        except Exception as exc:  # after the stream began: an error event, then the end
            if not isinstance(exc, ValueError | TandemError):
                logger.exception("unexpected error in a stream")  # the client sees only 500
            yield b"data: " + error_response(exc).body + b"\n\n"
        yield b"data: [DONE]\n\n"

    # NOTE: the bytes OpenAI's servers send (`data: {...}\n\n`, then `data:
    # [DONE]`, no keep-alive comments), which some clients parse by hand.
    # The response closes the body (and with it the request) when the client
    # disconnects; it does no more than that per event, as each streamed
    # token costs the host's cores (rpc/event_loop.py).
    # X-Accel-Buffering: a proxy in front (nginx) passes each event on at once.
    return _EventStream(body(), media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
