"""Exceptions that cross process boundaries, and their gRPC status codes.

Servicers raise these (or ValueError); ``ErrorInterceptor`` turns them into
statuses, so an error never travels as a string inside a success.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from rpc.refusal import refuse

logger = logging.getLogger("rpc")


class TandemError(Exception):
    code = grpc.StatusCode.INTERNAL


class NotFound(TandemError):
    code = grpc.StatusCode.NOT_FOUND


class Overloaded(TandemError):
    """No room now; retry later (REST 429, RESOURCE_EXHAUSTED)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(TandemError):
    """A server could not be reached or would not take the call; another
    may (UNAVAILABLE). What a failed call's UNAVAILABLE stands for: the
    caller cannot tell a draining peer from a dead one."""

    code = grpc.StatusCode.UNAVAILABLE


class Draining(Unavailable):
    """This server is shutting down; go elsewhere (REST 503, UNAVAILABLE)."""


class Unimplemented(TandemError):
    """This server's role does not serve the call (a prefill worker does
    not decode)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class LayoutMismatch(TandemError):
    """Two workers disagree on the model or KV layout."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(TandemError):
    """The call names a peer this worker may not connect to (not a
    registered worker), before any connection is tried."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Refused(TandemError):
    """What the call asks for is turned off here (the torch KV transport
    under TLS)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Fenced(TandemError):
    """A call from an attempt the gateway has already given up on."""

    code = grpc.StatusCode.ABORTED


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, TandemError):
        return exc.code
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


_FROM_CODE = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.FAILED_PRECONDITION: LayoutMismatch,
    grpc.StatusCode.ABORTED: Fenced,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def peer_error(err: grpc.aio.AioRpcError, peer: str = "a peer worker") -> TandemError:
    """A failed call this handler made to another worker, as this handler's
    own error: the peer's status and message, except that a peer's
    INVALID_ARGUMENT is our bug (INTERNAL), not our caller's bad input."""
    cls = _FROM_CODE.get(err.code(), TandemError)
    return cls(f"{peer}: {err.details()}")


def from_rpc_error(err: grpc.aio.AioRpcError) -> Exception:
    """The exception a failed call stands for, on the calling side."""
    if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(err.details())
    cls = _FROM_CODE.get(err.code(), TandemError)
    return cls(err.details())


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by any handler (unary or streaming) to statuses."""

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary,
                                                                client_stream=True))
        if handler.stream_stream:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream))
        return handler


def error_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a handler that raised ``exc`` answers with (an internal
    error is logged here)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        # NOTE: a call to another worker failed and nobody converted it:
        # grpc would answer UNKNOWN ("Unexpected AioRpcError").
        exc = peer_error(exc)
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("internal error in a gRPC handler", exc_info=exc)
    return code, str(exc) or type(exc).__name__


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    await context.abort(*error_status(exc))


def _wrap_unary(fn, client_stream: bool = False):
    """``client_stream``: the handler reads a stream of requests; a failure
    is answered once the caller has stopped sending (``rpc.refusal``)."""
    async def wrapper(request, context):
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except grpc.RpcError as err:
            if not isinstance(err, grpc.aio.AioRpcError):
                raise
            failure: Exception = err
        except Exception as exc:
            failure = exc
        if client_stream:
            await refuse(request, context)
        await _abort(context, failure)

    return wrapper


def _wrap_stream(fn):
    async def wrapper(request, context):
        try:
            async for item in fn(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except grpc.aio.AioRpcError as err:
            await _abort(context, err)
        except grpc.RpcError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapper
