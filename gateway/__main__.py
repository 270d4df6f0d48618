"""python -m gateway --prefill HOST:PORT --decode HOST:PORT [--port 8000] ..."""

from __future__ import annotations

import argparse
import logging

from gateway.app import run_gateway
from gateway.config import add_arguments, from_args
from rpc import event_loop
from rpc.logs import setup_logging
from rpc.parent_death import die_with_parent
from rpc.tracing import setup_tracing


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Tandem gateway")
    # Where this process listens and logs; GatewayConfig's flags follow.
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="REST port (0: any free port)")
    p.add_argument("--grpc-port", type=int, default=0, help="gRPC Generate port (0: any free)")
    p.add_argument("--log-format", default="plain", choices=["plain", "json"])
    add_arguments(p)
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    args = parse(argv)
    try:  # bad TLS files or limits end the start-up here, with the reason
        config = from_args(args)
    except ValueError as exc:
        raise SystemExit(f"gateway: error: {exc}") from None
    setup_logging(args.log_format)
    setup_tracing("tandem-gateway")
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    event_loop.run(run_gateway(config, args.host, args.port, args.grpc_port))


if __name__ == "__main__":
    main()
