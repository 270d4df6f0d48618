"""The gateway's Prometheus metrics: what clients experience end to end."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from rpc.metrics import RequestMetrics


class GatewayMetrics(RequestMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.rejected = Counter("tandem:requests_rejected",
                                "Requests refused because the server was full",
                                registry=self.registry)
        # NOTE: the gateway's own queue: admitted, no token yet (reserving,
        # prefilling); ``running`` counts those streaming tokens. Together
        # they are the requests in flight (--max-active-requests bounds them).
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Requests admitted that have no token yet", registry=self.registry)
        self.disagg_decisions = Counter(
            "tandem:disagg_decisions", "Where prompts were computed (--disagg-policy): "
            "remote on a prefill worker, or local on the decode worker", ["policy", "where"],
            registry=self.registry)
        self.state_store_up = Gauge("tandem:state_store_up",
                                    "1 while the request state store (Redis) answers; 0 while "
                                    "records are held in the gateway's memory",
                                    registry=self.registry)
