"""Runs the gateway: REST (uvicorn) and gRPC side by side on one event loop,
draining on SIGTERM: new requests get 503 / UNAVAILABLE, active ones finish
within the grace period."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl

import uvicorn

from gateway.auth import ApiKeyInterceptor
from gateway.config import GatewayConfig
from gateway.grpc_api import GenerationServicer
from gateway.openai_api import build_app
from gateway.service import GatewayService
from rpc.protos import generation_pb2, generation_pb2_grpc
from rpc.server import GrpcServer

logger = logging.getLogger("gateway")


async def run_gateway(config: GatewayConfig, host: str, port: int, grpc_port: int) -> None:
    service = GatewayService(config)
    await service.start()

    tls = config.tls
    # Callers of the gateway authenticate with API keys; a client certificate
    # only when --tls-client-ca-file asks for one.
    credentials = tls.server_credentials(config.tls_client_ca_file) if tls.enabled else None
    # The public port takes requests as large as a REST body, not a KV chunk.
    grpc_server = GrpcServer(host, grpc_port, interceptors=[ApiKeyInterceptor(service.keys)],
                             credentials=credentials, max_message_bytes=config.max_body_bytes)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(service),
                                                         grpc_server.server)
    grpc_server.add_service(generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name)
    await grpc_server.start()

    app = build_app(service)
    https: dict = {}
    if tls.enabled:
        https = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
        if config.tls_client_ca_file:
            https.update(ssl_ca_certs=config.tls_client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=5,
                                           **https))
    server.install_signal_handlers = lambda: None  # we handle SIGTERM ourselves
    serve = asyncio.ensure_future(server.serve())
    while not server.started:
        if serve.done():
            serve.result()  # raises why it could not start
            raise RuntimeError("the REST server stopped at start-up")
        await asyncio.sleep(0.02)
    http_port = server.servers[0].sockets[0].getsockname()[1]
    url = f"{'https' if tls.enabled else 'http'}://{host}:{http_port}"
    print(f"TANDEM_READY gateway gateway {host}:{http_port} grpc={host}:{grpc_server.port}",
          flush=True)
    logger.info("gateway serving %s at %s (gRPC %s:%d)", service.model_name, url, host,
                grpc_server.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.wait([asyncio.ensure_future(stop.wait()), serve],
                       return_when=asyncio.FIRST_COMPLETED)
    logger.info("draining")
    await grpc_server.set_serving(False)
    await service.drain()
    server.should_exit = True
    await grpc_server.stop(grace=1.0)
    await serve
    await service.stop()
