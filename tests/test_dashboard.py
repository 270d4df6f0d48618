"""The Grafana dashboard works against compose's Prometheus and against the
Kubernetes ServiceMonitors: it selects targets only by the `role` label,
which both scrape configurations set to the same values, and every metric
it plots is one a Tandem process exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from k8s_manifests import ROOT, of_kind, pod_labels, render, selects, workloads_selected
from prometheus_client.core import Metric

from gateway.metrics import GatewayMetrics
from gateway.router import WorkerPool, WorkerView
from gateway.worker_gauges import WorkerGauges
from worker.metrics import WorkerMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
METRIC = re.compile(r"\b((?:vllm|tandem):[a-zA-Z0-9_:]+)")


def expressions() -> list[str]:
    board = json.loads((DEPLOY / "grafana/dashboards/tandem.json").read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def compose_roles() -> set[str]:
    roles = set()
    for job in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]:
        for static in job.get("static_configs", []):
            roles.add(static["labels"]["role"])
        for r in job.get("relabel_configs", []):
            if r.get("target_label") == "role":
                roles.add(r["replacement"])
    return roles


def kubernetes_roles() -> set[str]:
    objects = render(ROOT / "overlays" / "cpu")
    roles = set()
    for monitor in of_kind(objects, "ServiceMonitor"):
        for endpoint in monitor["spec"]["endpoints"]:
            (relabel,) = [r for r in endpoint["relabelings"] if r["targetLabel"] == "role"]
            label = relabel["sourceLabels"][0].removeprefix("__meta_kubernetes_pod_label_")
            for s in of_kind(objects, "Service"):
                if selects(monitor["spec"]["selector"], s["metadata"]["labels"]):
                    for d in workloads_selected(objects, {"matchLabels": s["spec"]["selector"]}):
                        labels = {k.replace(".", "_").replace("/", "_").replace("-", "_"): v
                                  for k, v in pod_labels(d).items()}
                        roles.add(labels[label])
    return roles


def exported_names() -> set[str]:
    pool = WorkerPool(channels=None, fingerprint=None)
    pool.workers["a:1"] = WorkerView("a:1", role="decode", worker_id="d", healthy=True,
                                     num_blocks=4)
    families: list[Metric] = [*GatewayMetrics().registry.collect(),
                              *WorkerMetrics("w", "decode").registry.collect(),
                              *WorkerGauges(pool).collect()]
    # NOTE: by family, not by sample: a labelled counter nobody has
    # incremented yet has no samples.
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    return {f.name + s for f in families for s in suffixes.get(f.type, [""])}


def test_both_scrape_configs_give_the_same_roles():
    assert compose_roles() == kubernetes_roles() == {"gateway", "prefill", "decode"}


def test_dashboard_selects_targets_by_role_only():
    roles = compose_roles()
    own_labels = {"le", "finished_reason", "transport", "direction", "peer", "worker",
                  "worker_role", "address"}
    for expr in expressions():
        for label, _op, value in MATCHER.findall(expr):
            assert label in own_labels | {"role"}, f"{expr}: selects by {label!r}"
            if label == "role":
                assert any(re.fullmatch(value, r) for r in roles), expr


def test_dashboard_plots_exported_metrics():
    exported = exported_names()
    for expr in expressions():
        for name in METRIC.findall(expr):
            assert name in exported, f"{expr}: nothing exports {name}"
