"""What the Kubernetes tests share: every way deploy/kubernetes can be
rendered, and the pieces of a rendered set the cross-checks look up.

A plain module (like worker_fixtures.py), not conftest fixtures.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from pathlib import Path

import yaml
from kustomize_lite import build

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
# What the downward API would put in a pod's environment (pod 0 of a StatefulSet).
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
POD_FIELDS = {"status.podIP": "10.1.2.3", "metadata.name": "tandem-decode-abc12", POD_INDEX: "0"}
# The kinds whose pods run Tandem.
WORKLOADS = ("Deployment", "StatefulSet")


def kustomizations() -> list[Path]:
    """Every directory ``kubectl apply -k`` takes: the base and the overlays."""
    found = []
    for k in sorted(ROOT.rglob("kustomization.yaml")):
        if yaml.safe_load(k.read_text()).get("kind", "Kustomization") == "Kustomization":
            found.append(k.parent)
    return found


def components() -> list[Path]:
    return sorted(k.parent for k in ROOT.glob("components/*/kustomization.yaml"))


@functools.cache
def render(path: Path) -> tuple[dict, ...]:
    return tuple(build(path))


@functools.cache
def render_with(component: Path) -> tuple[dict, ...]:
    """The base plus one component, as an overlay of one's own would include it."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "namespace": "tandem",
            "resources": [os.path.relpath(ROOT / "base", d)],
            "components": [os.path.relpath(component, d)],
        }))
        return tuple(build(d))


@functools.cache
def every_rendering() -> dict[str, tuple[dict, ...]]:
    out = {str(p.relative_to(ROOT)): render(p) for p in kustomizations()}
    out.update({f"base+{c.relative_to(ROOT)}": render_with(c) for c in components()})
    return out


# ---- looking things up in a rendered set --------------------------------------------------


def of_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects, kind: str, name: str) -> dict | None:
    return next((o for o in of_kind(objects, kind) if o["metadata"]["name"] == name), None)


def workloads(objects) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOADS]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels and matchExpressions) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        if op == "In" and value not in e["values"] or op == "NotIn" and value in e["values"]:
            return False
        if op == "Exists" and value is None or op == "DoesNotExist" and value is not None:
            return False
    return True


def workloads_selected(objects, selector: dict) -> list[dict]:
    return [d for d in workloads(objects) if selects(selector, pod_labels(d))]


def container_env(objects, container: dict, pod_fields: dict[str, str] = POD_FIELDS,
                  ) -> dict[str, str]:
    """The environment the kubelet would give ``container`` (in a pod whose
    downward-API fields are ``pod_fields``)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        cm = named(objects, "ConfigMap", source["configMapRef"]["name"])
        env.update(cm["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        ref = e["valueFrom"]
        if "configMapKeyRef" in ref:
            r = ref["configMapKeyRef"]
            env[e["name"]] = named(objects, "ConfigMap", r["name"])["data"][r["key"]]
        elif "fieldRef" in ref:
            env[e["name"]] = pod_fields[ref["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in ref:
            resource = ref["resourceFieldRef"]["resource"]  # e.g. limits.cpu
            group, name = resource.split(".")
            env[e["name"]] = str(container["resources"][group][name])
        else:
            raise AssertionError(f"an env source this test does not know: {ref}")
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command arguments ($$ escapes)."""
    def one(m: re.Match) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        name = m.group(1)
        if name not in env:
            raise AssertionError(f"{arg!r}: $({name}) is not in the container's environment "
                                 "(Kubernetes would pass it on literally)")
        return env[name]

    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)
