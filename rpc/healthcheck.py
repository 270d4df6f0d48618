"""python -m rpc.healthcheck [HOST:PORT] [--tls-...] — exit 0 when the gRPC
server reports SERVING (container health checks).

The ``--tls-*`` flags are the servers' own and default to the same
``TANDEM_TLS_*`` variables, so inside a worker's container the check talks
mTLS with the worker's certificate when the worker does.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpc.tls import add_tls_arguments, tls_from_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="gRPC health check")
    p.add_argument("address", nargs="?", default="127.0.0.1:50051")
    add_tls_arguments(p)
    args = p.parse_args(argv)
    try:
        tls = tls_from_args(args)
    except ValueError as exc:
        print(f"{args.address}: {exc}", file=sys.stderr)
        return 1
    if tls.enabled:
        channel = grpc.secure_channel(args.address, tls.channel_credentials(),
                                      options=tls.channel_options())
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=3
            )
        except grpc.RpcError as err:
            print(f"{args.address}: {err.code().name}", file=sys.stderr)
            return 1
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
