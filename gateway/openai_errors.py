"""REST errors as OpenAI error objects: the status, type, code and ``param``
of each exception the API raises, and of a body that does not validate."""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.request_guard import error_body
from gateway.service import ModelNotFound
from rpc.errors import Draining, Overloaded, TandemError, Unavailable

RETRY_AFTER_S = "1"


def error_response(exc: BaseException) -> JSONResponse:
    """The status and OpenAI error object for an exception."""
    if isinstance(exc, Overloaded):
        return JSONResponse(error_body(str(exc), "rate_limit_error", "rate_limit_exceeded"), 429,
                            headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, Unavailable):
        code = "draining" if isinstance(exc, Draining) else "no_worker_available"
        return JSONResponse(error_body(str(exc), "service_unavailable", code), 503,
                            headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, ModelNotFound):
        return JSONResponse(error_body(str(exc), "invalid_request_error", "model_not_found",
                                       "model"), 404)
    if isinstance(exc, ValueError):
        return JSONResponse(error_body(str(exc), "invalid_request_error", None,
                                       _param_of(exc)), 400)
    if isinstance(exc, TandemError):
        return JSONResponse(error_body(str(exc), "server_error"), 502)
    return JSONResponse(error_body("internal error", "server_error"), 500)


# Fields a request may have: the Python API's messages start with the one they
# are about ("temperature must be ..."), which is then OpenAI's ``param``.
_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)
_FIRST_WORD = re.compile(r"[a-z_]+")


def _param_of(exc: ValueError) -> str | None:
    """The field a 400 is about: an InvalidField's, or the field its message
    starts with."""
    param = getattr(exc, "param", None)
    if param is None:
        first = _FIRST_WORD.match(str(exc))  # "logit_bias: ...", "structured_outputs.json ..."
        param = first[0] if first and first[0] in _FIELDS else None
    return param


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message and ``param`` of a body that does not fit the request's model."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    path = ".".join(loc)
    # OpenAI's `param` names the top-level field; the message has the full path
    # (which for a union includes the member tried, e.g. prompt.str).
    param = loc[0] if loc else None
    return (f"{path}: {first.get('msg')}" if path else str(first.get("msg"))), param
