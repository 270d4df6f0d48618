"""Clients that send one benchmark request and record what they saw.

``OpenAIClient`` streams ``/v1/completions`` over HTTP (any OpenAI-compatible
server); ``GrpcClient`` streams Tandem's ``tandem.v1.Generation/Generate``.
Both return a ``RequestRecord`` and never raise for a failed request: the
error goes in the record, so one failure does not end a run.
"""

from __future__ import annotations

import json
import time
from typing import Protocol

import httpx
from httpx_sse import aconnect_sse

from tandem.bench.datasets import BenchRequest
from tandem.bench.metrics import RequestRecord


class Client(Protocol):
    async def send(self, request: BenchRequest) -> RequestRecord: ...

    async def close(self) -> None: ...


def make_client(url: str, model: str | None = None, api_key: str | None = None,
                temperature: float = 0.0, ignore_eos: bool = True,
                timeout_s: float = 600.0) -> Client:
    """``http(s)://host:port`` -> OpenAI client; ``grpc://host:port`` -> gRPC."""
    if url.startswith("grpc://"):
        return GrpcClient(url.removeprefix("grpc://"), model, temperature, ignore_eos,
                          timeout_s)
    if url.startswith(("http://", "https://")):
        return OpenAIClient(url, model, api_key, temperature, ignore_eos, timeout_s)
    raise ValueError(f"--url must start with http://, https:// or grpc://, got {url!r}")


class OpenAIClient:
    def __init__(self, base_url: str, model: str | None, api_key: str | None,
                 temperature: float, ignore_eos: bool, timeout_s: float,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = base_url.rstrip("/").removesuffix("/v1") + "/v1/completions"
        self.model = model
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # NOTE: no connection limit: the arrival schedule, not the client's
        # pool, decides how many requests are in flight.
        self.http = httpx.AsyncClient(headers=headers, timeout=timeout_s, transport=transport,
                                      limits=httpx.Limits(max_connections=None,
                                                          max_keepalive_connections=None))

    def body(self, request: BenchRequest) -> dict:
        body = {"prompt": request.prompt_json, "max_tokens": request.output_len,
                "temperature": self.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = RequestRecord(prompt_len=request.prompt_len)
        record.start = time.perf_counter()
        try:
            async with aconnect_sse(self.http, "POST", self.url,
                                    json=self.body(request)) as source:
                response = source.response
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {text[:300]}"
                    return record
                async for event in source.aiter_sse():
                    if event.data == "[DONE]":
                        break
                    self._event(record, json.loads(event.data), time.perf_counter())
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            record.end = time.perf_counter()
        return record

    @staticmethod
    def _event(record: RequestRecord, event: dict, now: float) -> None:
        if "error" in event:
            record.error = str(event["error"].get("message", event["error"]))
            return
        text = "".join(c.get("text") or "" for c in event.get("choices") or [])
        if text:
            record.chunk_times.append(now)
            record.chunk_tokens.append(1)  # the API does not say how many
            record.text += text
        if event.get("usage"):
            record.usage_tokens = event["usage"].get("completion_tokens")

    async def close(self) -> None:
        await self.http.aclose()


class GrpcClient:
    def __init__(self, address: str, model: str | None, temperature: float,
                 ignore_eos: bool, timeout_s: float) -> None:
        import grpc

        from rpc.protos import generation_pb2_grpc

        self.channel = grpc.aio.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.model = model or ""
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s

    def message(self, request: BenchRequest):
        from rpc.protos import common_pb2, generation_pb2

        params = common_pb2.SamplingParams(max_tokens=request.output_len,
                                           temperature=self.temperature,
                                           ignore_eos=self.ignore_eos)
        if isinstance(request.prompt, str):
            return generation_pb2.GenerateRequest(text=request.prompt, params=params,
                                                  model=self.model)
        return generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=list(request.prompt)), params=params,
            model=self.model)

    async def send(self, request: BenchRequest) -> RequestRecord:
        import grpc

        record = RequestRecord(prompt_len=request.prompt_len)
        message = self.message(request)
        record.start = time.perf_counter()
        try:
            async for reply in self.stub.Generate(message, timeout=self.timeout_s):
                now = time.perf_counter()
                if reply.token_ids:
                    record.chunk_times.append(now)
                    record.chunk_tokens.append(len(reply.token_ids))
                    record.text += reply.text
                if reply.HasField("usage"):
                    record.usage_tokens = reply.usage.completion_tokens
        except grpc.aio.AioRpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
        finally:
            record.end = time.perf_counter()
        return record

    async def close(self) -> None:
        await self.channel.close()
