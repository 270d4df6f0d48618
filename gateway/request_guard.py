"""The checks every HTTP request passes before its route: the API key on
keyed paths, and for a POST the body's size and that it is Unicode text.

A plain ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one
relays every message of a response through an in-memory stream and a task
group of its own, which on a token stream (one SSE event per token, a few
thousand a second under load) cost about a third of the gateway's CPU. Here
the response's messages go straight to the server; only the request body
is read ahead (to check it) and handed to the route as one message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Paths that need the API key when the gateway has keys.
KEYED_PATHS = ("/v1/", "/metrics", "/openapi.json", "/docs", "/redoc", "/tokenize",
               "/detokenize")

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def error_body(message: str, type_: str, code: str | int | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def is_unicode_text(body: bytes) -> bool:
    """Whether the body is UTF-8 whose JSON strings are Unicode text: JSON
    may escape a lone surrogate (``"\\ud800"``), which no tokenizer or
    encoder downstream accepts."""
    try:
        body.decode("utf-8")
        if _SURROGATE_ESCAPE.search(body):  # rare: only then parse to check
            json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeError:
        return False
    except ValueError:  # not JSON: the route's parser says so
        return True
    return True


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse(error_body(f"the request body is larger than {limit} bytes",
                                   "invalid_request_error"), 413)


class RequestGuard:
    """ASGI middleware: ``check_key(authorization header) is None`` means the
    key is wrong (401); bodies over ``max_body_bytes`` get 413, bodies that
    are not Unicode text 400."""

    def __init__(self, app, check_key: Callable[[str | None], Any], max_body_bytes: int) -> None:
        self.app = app
        self.check_key = check_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if scope["path"].startswith(KEYED_PATHS) and \
                self.check_key(headers.get("authorization")) is None:
            response = JSONResponse(error_body("Incorrect or missing API key",
                                               "authentication_error", "invalid_api_key"), 401)
            await response(scope, receive, send)
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _too_large(limit)(scope, receive, send)
            return
        body, first = await self._read_body(receive, limit)
        if body is None:  # a chunked body declares no length
            await _too_large(limit)(scope, receive, send)
            return
        if first is None and not is_unicode_text(body):
            response = JSONResponse(error_body(
                "the request body is not valid UTF-8 (or escapes half of a UTF-16 surrogate "
                "pair)", "invalid_request_error"), 400)
            await response(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first or {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _read_body(receive: Receive, limit: int) -> tuple[bytes | None, Message | None]:
        """The whole body (None past ``limit``), or, when the client left
        before sending it all, the disconnect message for the route to see."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts), message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None, None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts), None
