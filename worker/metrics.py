"""Prometheus metrics of one worker process.

Names follow vLLM's where vLLM has the metric (``vllm:num_requests_running``
and friends), so existing dashboards work unchanged; the KV handoff has
Tandem's own (``tandem:kv_transfer_*``, ``tandem:kv_reservations_*``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class WorkerMetrics:
    def __init__(self, worker_id: str, role: str) -> None:
        self.registry = r = CollectorRegistry()
        self.worker_id, self.role = worker_id, role
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch",
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Requests waiting (for a batch slot or for their KV)", registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)",
                              registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency on this worker",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("vllm:request_generation_tokens",
                                           "Generated tokens per request",
                                           buckets=TOKEN_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               ["finished_reason"], registry=r)
        self.transfer_bytes = Counter("tandem:kv_transfer_bytes", "KV bytes moved",
                                      ["transport", "direction"], registry=r)
        self.transfer_seconds = Histogram("tandem:kv_transfer_seconds", "Duration of a KV transfer",
                                          ["transport", "direction"], buckets=LATENCY_BUCKETS,
                                          registry=r)
        self.transfer_failures = Counter("tandem:kv_transfer_failures", "Failed KV transfers",
                                         ["transport", "direction"], registry=r)
        self.reservations_held = Gauge("tandem:kv_reservations_held",
                                       "Reservations waiting for their KV or their start",
                                       registry=r)
        self.reservations_expired = Counter("tandem:kv_reservations_expired",
                                            "Reservations whose lease ran out unused", registry=r)
        self.peer_bandwidth = Gauge("tandem:kv_transport_bandwidth_bytes_per_second",
                                    "KV transport bandwidth to a peer, measured by the preflight on first contact",
                                    ["transport", "peer"], registry=r)
        self._prefix_seen = (0, 0)

    def observe_engine(self, engine) -> None:
        """Refresh the gauges and counters that mirror engine state (every step)."""
        self.running.set(engine.scheduler.num_running)
        self.waiting.set(engine.scheduler.num_waiting)
        self.kv_usage.set(engine.kv.usage)
        q, h = engine.kv.prefix_queries, engine.kv.prefix_hits
        self.prefix_queries.inc(q - self._prefix_seen[0])
        self.prefix_hits.inc(h - self._prefix_seen[1])
        self._prefix_seen = (q, h)

    def observe_transfer(self, transport: str, direction: str, nbytes: int, seconds: float,
                         ok: bool) -> None:
        if ok:
            self.transfer_bytes.labels(transport, direction).inc(nbytes)
            self.transfer_seconds.labels(transport, direction).observe(seconds)
        else:
            self.transfer_failures.labels(transport, direction).inc()

    def observe_finished(self, prompt_tokens: int, generated: int, reason: str,
                         e2e: float) -> None:
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generated)
        self.success.labels(reason).inc()
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
