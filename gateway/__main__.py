"""python -m gateway --prefill HOST:PORT --decode HOST:PORT [--port 8000] ..."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from gateway.app import run_gateway
from gateway.service import GatewayConfig
from rpc.logs import setup_logging
from rpc.tracing import setup_tracing


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Tandem gateway")
    p.add_argument("--model", default=None,
                   help="the model the workers serve (for the tokenizer); default SmolLM2")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="REST port (0: any free port)")
    p.add_argument("--grpc-port", type=int, default=0, help="gRPC Generate port (0: any free)")
    p.add_argument("--prefill", action="append", default=[], help="prefill worker address")
    p.add_argument("--decode", action="append", default=[],
                   help="decode (or 'both') worker address")
    p.add_argument("--state-url", default=os.environ.get("REDIS_URL"),
                   help="Redis URL for request state and worker registration "
                        "(default $REDIS_URL; none: in-process)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    p.add_argument("--transport", default="grpc", choices=["grpc", "torch"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-active-requests", type=int, default=256)
    p.add_argument("--lease-ms", type=int, default=30_000)
    p.add_argument("--finished-ttl", type=int, default=3600,
                   help="seconds finished request records are kept")
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--log-format", default="plain", choices=["plain", "json"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    setup_logging(args.log_format)
    setup_tracing("tandem-gateway")
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    config = GatewayConfig(
        model=args.model, served_model_name=args.served_model_name,
        prefill=tuple(args.prefill), decode=tuple(args.decode), state_url=args.state_url,
        api_key=args.api_key, transport=args.transport, max_model_len=args.max_model_len,
        max_active_requests=args.max_active_requests, lease_ms=args.lease_ms,
        finished_ttl_s=args.finished_ttl, drain_grace_s=args.grace,
    )
    asyncio.run(run_gateway(config, args.host, args.port, args.grpc_port))


if __name__ == "__main__":
    main()
