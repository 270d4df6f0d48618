"""API keys: which callers may use the gateway, on REST and gRPC alike.

Keys come from ``--api-key`` (one, or several separated by commas) and from
``--api-key-file`` (one per line, ``#`` comments), which is read again when
it changes, so keys rotate without a restart. A caller presents one as
``Authorization: Bearer <key>`` (an HTTP header, or gRPC metadata). Every
key is compared in constant time, so the answer's timing tells nothing
about how much of a key matched.

A request remembers the digest of the key that created it: only a caller
with that same key may abort it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import grpc

# gRPC services anyone may call: load balancers probe health, tools list services.
OPEN_GRPC_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ApiKeys:
    def __init__(self, keys: str | None, key_file: str | None = None) -> None:
        self._inline = [k.strip() for k in (keys or "").split(",") if k.strip()]
        self._file = Path(key_file) if key_file else None
        self._file_keys: list[str] = []
        self._file_stamp: tuple[int, int] | None = None
        if self._file is not None:
            self._reload()  # a missing or unreadable file fails the start, not a request

    @property
    def enabled(self) -> bool:
        return bool(self._inline) or self._file is not None

    def _reload(self) -> None:
        stat = os.stat(self._file)
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._file_stamp:
            return
        # A key a line: its first word (a bearer token has no spaces), so a
        # comment may follow it; a line whose first word starts with "#",
        # indented or not, is a comment.
        words = [ln.split() for ln in self._file.read_text().splitlines()]
        self._file_keys = [w[0] for w in words if w and not w[0].startswith("#")]
        self._file_stamp = stamp

    def _keys(self) -> list[str]:
        if self._file is not None:
            try:
                self._reload()
            except OSError:  # mid-rotation (replaced, not yet written): keep the last keys
                pass
        return [*self._inline, *self._file_keys]

    def check(self, authorization: str | None) -> str | None:
        """The digest of the key in an ``Authorization`` value, or None when
        it names no valid key. With no keys configured everyone is "" (allowed)."""
        if not self.enabled:
            return ""
        value = authorization or ""
        given = value[7:] if value[:7].lower() == "bearer " else ""
        ok = False
        for key in self._keys():  # no early exit: every key costs the same
            ok |= hmac.compare_digest(given.encode(), key.encode())
        return owner_of(given) if ok and given else None


def owner_of(key: str) -> str:
    """What a request records of the key that created it (never the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without a valid key, before the method runs."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not self.keys.enabled or \
                details.method.startswith(OPEN_GRPC_SERVICES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self.keys.check(metadata.get("authorization")) is not None:
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or invalid API key (send 'authorization: Bearer <key>' metadata)"

    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # NOTE: unreachable; makes this a response stream like the method's

    codec = dict(request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **codec)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **codec)
