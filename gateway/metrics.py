"""The gateway's Prometheus metrics: what clients experience end to end."""

from __future__ import annotations

from prometheus_client import Counter

from rpc.metrics import RequestMetrics


class GatewayMetrics(RequestMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.rejected = Counter("tandem:requests_rejected",
                                "Requests refused because the server was full",
                                registry=self.registry)
