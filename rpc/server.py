"""A grpc.aio server with Tandem's defaults: size limits, the error
interceptor, the standard health service and reflection."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rpc.channel import OPTIONS
from rpc.errors import ErrorInterceptor

logger = logging.getLogger("rpc")


class GrpcServer:
    def __init__(self, host: str, port: int, interceptors: list | None = None,
                 credentials: grpc.ServerCredentials | None = None,
                 max_message_bytes: int | None = None) -> None:
        """``credentials``: serve TLS (``TLSConfig.server_credentials``).
        ``max_message_bytes``: the largest message a caller may send (default
        OPTIONS', sized for KV chunks between workers)."""
        options = OPTIONS if max_message_bytes is None else [
            *(o for o in OPTIONS if o[0] != "grpc.max_receive_message_length"),
            ("grpc.max_receive_message_length", max_message_bytes)]
        self.server = grpc.aio.server(
            interceptors=[ErrorInterceptor(), *(interceptors or [])], options=options
        )
        address = f"{host}:{port}"
        self.port = (self.server.add_insecure_port(address) if credentials is None
                     else self.server.add_secure_port(address, credentials))
        if self.port == 0:
            raise RuntimeError(f"could not bind {host}:{port}")
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]

    def add_service(self, full_name: str) -> None:
        self._service_names.append(full_name)

    async def start(self) -> None:
        reflection.enable_server_reflection([*self._service_names, reflection.SERVICE_NAME],
                                            self.server)
        await self.server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)


async def serve_until_signal(
    start: Callable[[], Awaitable[None]], drain: Callable[[], Awaitable[None]],
    broken: asyncio.Event | None = None,
) -> bool:
    """Start, then on SIGTERM/SIGINT, or once ``broken`` is set, run
    ``drain`` (stop taking work, finish what is in flight within the grace
    period) and return whether it was ``broken`` that ended the service."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await start()
    waits = [asyncio.ensure_future(e.wait()) for e in (stop, broken) if e is not None]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    failed = broken is not None and broken.is_set() and not stop.is_set()
    logger.info("%s: draining", "the engine is unusable" if failed else "signal received")
    await drain()
    return failed
