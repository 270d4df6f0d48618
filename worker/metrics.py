"""Prometheus metrics of one worker process.

Names follow vLLM's where vLLM has the metric (``vllm:num_requests_running``
and friends), so existing dashboards work unchanged; the KV handoff has
Tandem's own (``tandem:kv_transfer_*``, ``tandem:kv_reservations_*``).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from engine.spec_decode.stats import SpecDecodeStats
from rpc.metrics import LATENCY_BUCKETS, RequestMetrics


class WorkerMetrics(RequestMetrics):
    def __init__(self, worker_id: str, role: str) -> None:
        super().__init__()
        r = self.registry
        self.worker_id, self.role = worker_id, role
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Requests waiting (for a batch slot or for their KV)", registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)",
                              registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", registry=r)
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
        self.decode_streams = Gauge("tandem:decode_streams",
                                    "Open DecodeMany streams (one per gateway that decodes here)",
                                    registry=r)
        self.decode_stream_messages = Counter(
            "tandem:decode_stream_messages",
            "Messages written on DecodeMany streams (each holds every request's new chunk)",
            registry=r)
        self.decode_stream_chunks = Counter(
            "tandem:decode_stream_chunks", "Request chunks written on DecodeMany streams",
            registry=r)
        self.reservations_expired = Counter("tandem:kv_reservations_expired",
                                            "Reservations whose lease ran out unused", registry=r)
        self.peer_bandwidth = Gauge("tandem:kv_transport_bandwidth_bytes_per_second",
                                    "KV transport bandwidth to a peer, measured by the preflight on first contact",
                                    ["transport", "peer"], registry=r)
        self.transport_fallbacks = Counter(
            "tandem:kv_transport_fallbacks",
            "A KV transport stood in for another that could not start (when=start) or that "
            "this worker or its peer does not run (when=request)",
            ["wanted", "used", "when"], registry=r)
        self._prefix_seen = (0, 0)
        # Speculative decoding, as vLLM names it (zero without speculation).
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts",
                                   "Proposals verified (one per sequence per step)", registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens",
                                         "Tokens proposed and verified", registry=r)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                            "Proposed tokens accepted", registry=r)
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Proposals whose token at this position was accepted", ["position"], registry=r)
        self._spec_seen = SpecDecodeStats()
        self.host_tier_restored = Counter(
            "tandem:kv_host_tier_restored_blocks",
            "Prefix-cache blocks copied back from the host KV tier instead of recomputed",
            registry=r)
        self.host_tier_bytes = Counter("tandem:kv_host_tier_bytes",
                                       "Bytes moved between the KV cache and the host tier",
                                       registry=r)
        self._tier_seen = (0, 0)
        self.borrowed_steps = Counter(
            "tandem:cpu_borrowed_steps",
            "Engine steps that also computed on cores borrowed from an idle worker of this host "
            "(--borrow-cores)", registry=r)
        self._borrowed_seen = 0
        self.lent_steps = Counter(
            "tandem:cpu_lent_steps",
            "Steps of a waiting prefill worker of this host that this worker, busy itself, "
            "lent its cores to (--borrow-cores)", registry=r)
        self._lent_seen = 0

    def count_from(self, stats, cores=None) -> None:
        """Count from the engine's ``stats`` (an ``EngineStats``) and its
        core lease's step counts (``cores``, if any) on: what the engine did
        before serving (its warm-up) is not served traffic."""
        self._prefix_seen = (stats.prefix_queries, stats.prefix_hits)
        self._tier_seen = (stats.host_tier_restored_blocks, stats.host_tier_bytes)
        if stats.spec_decode is not None:
            self._spec_seen = stats.spec_decode
        if cores is not None:
            self._borrowed_seen, self._lent_seen = cores.steps_borrowing, cores.steps_lent

    def observe_engine(self, engine) -> None:
        """Refresh the gauges and counters that mirror engine state (every step)."""
        stats = engine.stats()
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        q, h = stats.prefix_queries, stats.prefix_hits
        self.prefix_queries.inc(q - self._prefix_seen[0])
        self.prefix_hits.inc(h - self._prefix_seen[1])
        self._prefix_seen = (q, h)
        restored, moved = stats.host_tier_restored_blocks, stats.host_tier_bytes
        self.host_tier_restored.inc(restored - self._tier_seen[0])
        self.host_tier_bytes.inc(moved - self._tier_seen[1])
        self._tier_seen = (restored, moved)
        if stats.spec_decode is not None:
            self._observe_spec(stats.spec_decode)

    def observe_cores(self, steps_borrowing: int, steps_lent: int) -> None:
        self.borrowed_steps.inc(steps_borrowing - self._borrowed_seen)
        self._borrowed_seen = steps_borrowing
        self.lent_steps.inc(steps_lent - self._lent_seen)
        self._lent_seen = steps_lent

    def _observe_spec(self, now: SpecDecodeStats) -> None:
        seen = self._spec_seen
        if now.num_drafts == seen.num_drafts:  # no verification since: the usual no-hit step
            return
        self.spec_drafts.inc(now.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(now.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted_tokens.inc(now.num_accepted_tokens - seen.num_accepted_tokens)
        for pos, count in enumerate(now.accepted_per_pos):
            before = seen.accepted_per_pos[pos] if pos < len(seen.accepted_per_pos) else 0
            self.spec_accepted_per_pos.labels(str(pos)).inc(count - before)
        self._spec_seen = now

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
