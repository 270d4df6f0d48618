"""vLLM's routes beside the OpenAI API, for clients and probes written
against vLLM's server: ``/version``, ``/ping``, ``/tokenize``, ``/detokenize``."""

from __future__ import annotations

import importlib.metadata

from fastapi import FastAPI, Response

from gateway.protocol import DetokenizeRequest, TokenizeRequest
from gateway.service import GatewayService
from gateway.tool_parsers import make_parser
from gateway.tools import chat_messages, parse_tool_choice

try:
    TANDEM_VERSION = importlib.metadata.version("tandem-serve")  # pyproject.toml's
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was not installed
    TANDEM_VERSION = "unknown"


def add_vllm_routes(app: FastAPI, service: GatewayService) -> None:
    @app.get("/version")
    async def version():
        return {"version": TANDEM_VERSION}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():  # vLLM's (and SageMaker's) liveness probe
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """The token ids of a prompt, or of chat messages through the chat
        template, and the context they must fit in."""
        service.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("give either prompt or messages")
        if body.messages is not None:
            service.check_chat(len(body.messages))
            # As /v1/chat/completions gives them to the template (earlier
            # tool calls and results included), with no tools offered.
            messages, _ = await service.off_loop(
                chat_messages, body.messages, [], parse_tool_choice(None, []),
                service.tokenizer.chat_template or "",
                make_parser(service.config.tool_call_parser))
            tokens = await service.off_loop(service.tokenize_chat, messages,
                                            body.chat_options())
        else:
            tokens = await service.off_loop(service.tokenize_text, body.prompt,
                                            body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": service.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        service.check_model(body.model)
        service.model_config.check_prompt(body.tokens)  # ids inside the vocabulary
        # NOTE: special tokens kept, as vLLM's (Hugging Face's decode): ids
        # of a chat-templated prompt come back with their turn markers.
        return {"prompt": await service.off_loop(service.tokenizer.decode, body.tokens, False)}
