"""The generated protobuf modules, built from protos/ on first import if stale."""

from __future__ import annotations

from rpc.build import ensure_built

ensure_built()

from rpc.generated.tandem.v1 import (  # noqa: E402
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

__all__ = ["common_pb2", "generation_pb2", "generation_pb2_grpc", "worker_pb2", "worker_pb2_grpc"]
