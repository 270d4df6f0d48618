"""The request metrics every Tandem process reports, under vLLM's names so
existing dashboards work: what a request experienced, seen from the process
that reports it (the gateway: the client's view; a worker: its share)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class RequestMetrics:
    """Own registry per instance: two in one process (tests) never collide."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("vllm:num_requests_running", "Requests being served", registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("vllm:request_generation_tokens",
                                           "Generated tokens per completion",
                                           buckets=TOKEN_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Finished completions by finish reason",
                               ["finished_reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
