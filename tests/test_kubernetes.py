"""deploy/kubernetes renders, and every object it renders is valid.

Rendered by tests/kustomize_lite.py (and compared with ``kubectl
kustomize`` where kubectl is installed), then checked against the
Kubernetes OpenAPI schemas shipped in the ``kubernetes-validate`` package
(offline, strict: an unknown field is an error) for the oldest version the
manifests target and the newest the package knows. The two custom resources
(ServiceMonitor, ScaledObject) have no schema there; the fields used here
are checked against the small schemas below, written from the Prometheus
operator's and KEDA's API references.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_manifests import ROOT, every_rendering, kustomizations, render

OLDEST = "1.29.0"  # kubelet gRPC probes are GA from 1.27; policy/v1, autoscaling/v2 older
VERSIONS = (OLDEST, kubernetes_validate.latest_version())

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": _STR_MAP,
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "additionalProperties": False, "required": ["key", "operator"],
        "properties": {"key": {"type": "string"}, "values": {"type": "array"},
                       "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]}}}}}}
_META = {"type": "object", "required": ["name", "namespace"]}
_RELABEL = {"type": "object", "additionalProperties": False, "properties": {
    "sourceLabels": {"type": "array", "items": {"type": "string"}},
    "targetLabel": {"type": "string"}, "replacement": {"type": "string"},
    "action": {"type": "string"}, "regex": {"type": "string"}}}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object", "required": ["spec"], "properties": {"metadata": _META, "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
            "properties": {"selector": _SELECTOR, "endpoints": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"},
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "authorization": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "type": {"type": "string"},
                            "credentials": {"type": "object", "additionalProperties": False,
                                            "required": ["name", "key"], "properties": {
                                                "name": {"type": "string"},
                                                "key": {"type": "string"}}}}},
                    "relabelings": {"type": "array", "items": _RELABEL}}}}}}}},
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object", "required": ["spec"], "properties": {"metadata": _META, "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"], "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"]},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer"}, "cooldownPeriod": {"type": "integer"},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "horizontalPodAutoscalerConfig": {"type": "object", "properties": {
                        "behavior": {"type": "object"}}}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "properties": {
                        "type": {"const": "prometheus"},
                        "metadata": {"type": "object", "additionalProperties": False,
                                     "required": ["serverAddress", "query", "threshold"],
                                     "properties": {"serverAddress": {"type": "string"},
                                                    "query": {"type": "string"},
                                                    "threshold": {"type": "string",
                                                                  "pattern": r"^[0-9.]+$"}}}}}},
            }}}},
}

RENDERINGS = every_rendering()


def validate(obj: dict) -> None:
    schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.validate(obj, schema)
        return
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", sorted(RENDERINGS))
def test_every_object_is_valid(name):
    objects = RENDERINGS[name]
    assert objects
    for obj in objects:
        try:
            validate(obj)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as err:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: "
                        f"{getattr(err, 'message', err)}")


def test_every_object_is_namespaced_and_unique():
    for name, objects in RENDERINGS.items():
        ids = [(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in objects]
        assert len(ids) == len(set(ids)), f"{name}: duplicate objects"
        for o in objects:
            if o["kind"] != "Namespace":
                assert o["metadata"]["namespace"] == "tandem", (name, o["metadata"])


@pytest.mark.parametrize("mistake", ["typo", "bad-port", "crd"])
def test_the_validation_catches_mistakes(mistake):
    objects = render(next(p for p in kustomizations() if p.name == "cpu"))
    if mistake == "crd":
        obj = copy.deepcopy(next(o for o in objects if o["kind"] == "ServiceMonitor"))
        obj["spec"]["endpoints"][0]["intervall"] = "5s"
    else:
        obj = copy.deepcopy(next(o for o in objects if o["kind"] == "Deployment"))
        container = obj["spec"]["template"]["spec"]["containers"][0]
        if mistake == "typo":
            container["readinesProbe"] = container.pop("readinessProbe")
        else:
            container["ports"][0]["containerPort"] = "fifty"
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(obj)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: p.name)
def test_renders_as_kubectl_does(path):
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60, check=True).stdout

    def key(o):
        return (o["kind"], o["metadata"]["name"])

    theirs = sorted((o for o in yaml.safe_load_all(out) if o), key=key)
    assert sorted(render(path), key=key) == theirs


def test_the_overlay_in_docs_deploy_md_renders(tmp_path):
    """docs/deploy.md's own overlay (image, keys, model) with its
    tensor-parallel patch: it renders and every object stays valid."""
    from kustomize_lite import build

    doc = (ROOT.parent.parent / "docs" / "deploy.md").read_text()
    overlay = re.search(r"cat > kustomization.yaml <<'EOF'\n(.*?)\nEOF", doc, re.S).group(1)
    tp = re.search(r"```yaml\npatches:\n(.*?)```", doc, re.S).group(1)
    overlay = overlay.replace("../deploy/kubernetes/", os.path.relpath(ROOT, tmp_path) + "/")
    (tmp_path / "kustomization.yaml").write_text(overlay + "\n" + tp)
    objects = build(tmp_path)
    for obj in objects:
        validate(obj)
    decode = next(o for o in objects if o["metadata"]["name"] == "tandem-decode"
                  and o["kind"] == "Deployment")
    (container,) = decode["spec"]["template"]["spec"]["containers"]
    assert "--tensor-parallel-size=4" in container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["image"] == "REGISTRY/tandem:cuda"
