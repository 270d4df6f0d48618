"""The workers' current load on the gateway's /metrics, one series per worker.

The gateway polls every worker's ``Info`` twice a second to route
(gateway/router.py); this collector serves what the last poll saw, so one
scrape of the gateway (or one ``curl``) shows the whole cluster: how busy each
prefill and decode worker is, whether it answers, and how full its KV cache
is. Each worker still serves its own /metrics, with the full histograms.
It also names the prefill -> decode pairs kept apart after failed handoffs.

The names are Tandem's own (``tandem:worker_*``), not vLLM's: a
``sum(vllm:num_requests_running)`` over every scraped target must not count
a worker twice, once from the worker and once from the gateway. The labels
are ``worker`` (its id) and ``worker_role``: a scrape config that adds a
``role`` target label (deploy/prometheus.yml, the ServiceMonitor in
deploy/kubernetes) then does not clash with them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.router import WorkerPool

LABELS = ["worker", "worker_role", "address"]


class WorkerGauges(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("tandem:worker_up", "1 while the worker answers the gateway's "
                               "polls and takes new work (0: unreachable, draining or refused)",
                               labels=LABELS)
        running = GaugeMetricFamily("tandem:worker_num_requests_running",
                                    "Requests the worker is running, at the last poll",
                                    labels=LABELS)
        waiting = GaugeMetricFamily("tandem:worker_num_requests_waiting",
                                    "Requests waiting on the worker, at the last poll",
                                    labels=LABELS)
        kv = GaugeMetricFamily("tandem:worker_kv_cache_usage_perc",
                               "Fraction of the worker's KV blocks in use (0-1), at the last poll",
                               labels=LABELS)
        for w in list(self.pool.workers.values()):
            labels = [w.worker_id or w.address, w.role or "unknown", w.address]
            up.add_metric(labels, 1.0 if w.usable else 0.0)
            if not w.healthy:
                continue  # its numbers are from before it stopped answering
            running.add_metric(labels, w.num_running)
            waiting.add_metric(labels, w.num_waiting)
            if w.num_blocks:
                kv.add_metric(labels, 1.0 - w.free_blocks / w.num_blocks)
        apart = GaugeMetricFamily("tandem:kv_handoff_pair_apart",
                                  "1 while the gateway keeps a prefill and a decode worker "
                                  "apart after failed KV handoffs (gateway/pair_health.py)",
                                  labels=["prefill", "decode"])
        for prefill, decode in self.pool.pairs.apart_now():
            apart.add_metric([prefill, decode], 1.0)
        yield from (up, running, waiting, kv, apart)

    def describe(self) -> list:
        return []  # NOTE: the series change with the workers; collect() at registration is wasted
