"""The public gRPC API: tandem.v1.Generation.

Cancelling a Generate call aborts the request on every worker (the stream's
generator is closed, and the orchestrator aborts what it started).
"""

from __future__ import annotations

import dataclasses
import re
import uuid

from opentelemetry import context as otel_context

from engine.completions import SEQUENCE_SEPARATOR
from engine.config import default_of
from engine.sampling_params import SamplingParams
from gateway.service import GatewayService
from rpc.convert import params_from_proto, set_stop_reason
from rpc.protos import common_pb2, generation_pb2, generation_pb2_grpc

MAX_REQUEST_ID_CHARS = 256  # ids travel in every worker call, log line and record
# generation.proto: "0 means 16", SamplingParams' own default.
DEFAULT_MAX_TOKENS = default_of(SamplingParams, "max_tokens")
# Printable ASCII without spaces, and never the sequence separator: an id
# is written into log lines and records, and "job#0" is completion 0 of
# request "job".
_REQUEST_ID = re.compile(r"[!-~]+")


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id may have at most {MAX_REQUEST_ID_CHARS} characters, "
                         f"got {len(request_id)}")
    if not _REQUEST_ID.fullmatch(request_id) or SEQUENCE_SEPARATOR in request_id:
        raise ValueError(f"request_id must be printable ASCII without spaces or "
                         f"{SEQUENCE_SEPARATOR!r}, got {request_id!r}")


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, service: GatewayService) -> None:
        self.service = service
        # Running Generate calls: request id -> digest of the key that made it.
        self._owners: dict[str, str] = {}

    async def Generate(self, request: generation_pb2.GenerateRequest, context):
        service = self.service
        service.check_model(request.model or None)
        # Off the event loop: an output constraint's grammar compiles here.
        params = await service.off_loop(params_from_proto, request.params)
        if request.WhichOneof("prompt") == "text":
            prompt = await service.off_loop(service.tokenize_prompt, request.text)
        elif request.WhichOneof("prompt") == "token_ids":
            prompt = await service.off_loop(service.tokenize_prompt, list(request.token_ids.ids))
        else:
            raise ValueError("prompt must not be empty")
        if not request.params.max_tokens:
            # NOTE: a new, validated object. 16, as the proto says and as
            # REST's completions: past the context it is refused, not cut.
            params = dataclasses.replace(params, max_tokens=DEFAULT_MAX_TOKENS)
        service.check_request(prompt, params)
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        check_request_id(request_id)
        if request_id in self._owners:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._owners[request_id] = self._caller(context)
        try:
            async for reply in self._generate(prompt, params, request_id):
                yield reply
        finally:
            del self._owners[request_id]

    async def _generate(self, prompt, params, request_id: str):
        service = self.service
        completion_tokens = 0
        cached = 0
        remaining = params.n
        # The current context holds the gRPC server span of this call (the
        # grpc.aio instrumentation), itself a child of the caller's trace.
        async for chunk in service.generate(prompt, params, request_id,
                                            otel_context.get_current()):
            completion_tokens += len(chunk.token_ids)
            reply = generation_pb2.GenerateResponse(
                request_id=request_id, index=chunk.index, token_ids=chunk.token_ids,
                text=chunk.text, logprobs=chunk.logprobs,
                finish_reason=chunk.finish_reason or "", prompt_logprobs=chunk.prompt_logprobs,
            )
            if chunk.finish_reason:
                set_stop_reason(reply, chunk.stop_reason)
                remaining -= 1
                cached = max(cached, chunk.cached_tokens)
                if remaining == 0:
                    reply.usage.CopyFrom(common_pb2.Usage(
                        prompt_tokens=len(prompt), completion_tokens=completion_tokens,
                        cached_tokens=cached,
                    ))
            yield reply

    async def Abort(self, request: generation_pb2.GenerateAbortRequest, context):
        # Only the key that started a request may abort it; to any other
        # caller it does not exist.
        if self._owners.get(request.request_id) != self._caller(context):
            return generation_pb2.GenerateAbortResponse(found=False)
        found = await self.service.orchestrator.abort(request.request_id)
        return generation_pb2.GenerateAbortResponse(found=found)

    def _caller(self, context) -> str:
        """The digest of the caller's key (the interceptor let only valid ones in)."""
        metadata = dict(context.invocation_metadata() or ())
        return self.service.keys.check(metadata.get("authorization")) or ""
