"""Render a kustomization the way ``kubectl kustomize`` does, for the subset
deploy/kubernetes uses, so that ``make test`` checks the manifests on a
machine without kubectl (tests/test_kubernetes.py compares the two where
kubectl exists).

Supported: ``resources`` (files and directories), ``components``,
``namespace``, ``labels`` (without ``includeSelectors``), ``images``, and
``patches`` with a ``target`` (kind and a name, a regular expression as in
kustomize), either a strategic-merge patch (``$patch: delete`` at its top
removes the targets) or a JSON patch (RFC 6902: add, replace, remove).
Anything else in a kustomization is an error here, not silently skipped.

Order, as kustomize applies it: a kustomization's resources, then each
component (its resources join, then its transformers run over everything
so far), then the kustomization's own patches, namespace, labels, images.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "namespace", "labels",
                "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "PriorityClass"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
# Strategic merge: lists merged element by element on these keys (as the
# Kubernetes types declare them); every other list is replaced whole.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "mountPath", "imagePullSecrets": "name"}
PORT_KEYS = {"containerPort", "port"}


def build(path: Path | str) -> list[dict]:
    """The objects ``kubectl kustomize path`` prints, in file order."""
    path = Path(path)
    k = _load_kustomization(path, "Kustomization")
    objects = _resources(path, k)
    for component in k.get("components", []):
        objects = _component(path / component, objects)
    return _transform(path, k, objects)


def _load_kustomization(path: Path, kind: str) -> dict:
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    if k.get("kind", "Kustomization") != kind:
        raise ValueError(f"{path}: expected a {kind}, found {k.get('kind')}")
    unknown = set(k) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{path}/kustomization.yaml: unsupported fields {sorted(unknown)}")
    return k


def _resources(path: Path, k: dict) -> list[dict]:
    objects: list[dict] = []
    for entry in k.get("resources", []):
        target = path / entry
        if target.is_dir():
            objects += build(target)
        else:
            objects += [d for d in yaml.safe_load_all(target.read_text()) if d]
    return objects


def _component(path: Path, objects: list[dict]) -> list[dict]:
    k = _load_kustomization(path, "Component")
    objects = objects + _resources(path, k)
    for component in k.get("components", []):
        objects = _component(path / component, objects)
    return _transform(path, k, objects)


def _transform(path: Path, k: dict, objects: list[dict]) -> list[dict]:
    objects = [copy.deepcopy(o) for o in objects]
    for patch in k.get("patches", []):
        _apply_patch(path, patch, objects)
    if "namespace" in k:
        for o in objects:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    for entry in k.get("labels", []):
        if entry.get("includeSelectors"):
            raise ValueError("labels with includeSelectors are not supported here")
        for o in objects:
            o["metadata"].setdefault("labels", {}).update(entry["pairs"])
            if entry.get("includeTemplates") and o["kind"] in WORKLOADS:
                template = o["spec"]["template"].setdefault("metadata", {})
                template.setdefault("labels", {}).update(entry["pairs"])
    for image in k.get("images", []):
        for o in objects:
            for c in _containers(o):
                _set_image(c, image)
    return objects


# ---- patches ----------------------------------------------------------------------------


def _apply_patch(path: Path, patch: dict, objects: list[dict]) -> None:
    text = patch["patch"] if "patch" in patch else (path / patch["path"]).read_text()
    body = yaml.safe_load(text)
    target = patch.get("target")
    if target is None:
        raise ValueError(f"{path}: give every patch a target")
    matched = [o for o in objects if _matches(o, target)]
    if not matched:
        raise ValueError(f"{path}: patch target {target} matches nothing")
    if isinstance(body, dict) and body.get("$patch") == "delete":
        objects[:] = [o for o in objects if not any(o is m for m in matched)]
        return
    for o in matched:
        if isinstance(body, list):
            for op in body:
                _json_patch(o, op)
        else:
            # NOTE: with a target, a patch's kind and name only name it:
            # kustomize applies it to each target as if it were of that kind.
            merged = _merge(o, {k: v for k, v in body.items()
                                if k not in ("metadata", "apiVersion", "kind")})
            if "metadata" in body:  # the patch's own name only names a target
                meta = {k: v for k, v in body["metadata"].items() if k not in ("name",)}
                merged["metadata"] = _merge(merged["metadata"], meta)
            o.clear()
            o.update(merged)


def _matches(o: dict, target: dict) -> bool:
    for field in ("kind", "name", "namespace"):
        if field in target:
            value = o["kind"] if field == "kind" else o["metadata"].get(field, "")
            if not re.fullmatch(target[field], value):
                return False
    return True


def _merge(base: Any, patch: Any, key: str = "") -> Any:
    """Strategic merge of ``patch`` into ``base`` (a new value)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = _merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        merge_key = MERGE_KEYS.get(key)
        if merge_key is None and key == "ports" and base and isinstance(base[0], dict):
            merge_key = next((p for p in PORT_KEYS if p in base[0]), None)
        if merge_key is None:
            return copy.deepcopy(patch)
        out = [copy.deepcopy(b) for b in base]
        new = []  # NOTE: kustomize puts the patch's new elements first
        for item in patch:
            match = next((i for i, b in enumerate(out) if b.get(merge_key) == item[merge_key]),
                         None)
            if match is None:
                new.append(copy.deepcopy(item))
            else:
                out[match] = _merge(out[match], item)
        return new + out
    return copy.deepcopy(patch)


def _json_patch(o: dict, op: dict) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~")
                      for p in op["path"].lstrip("/").split("/")]
    node: Any = o
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    kind = op["op"]
    if kind == "add":
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        else:
            node[last] = copy.deepcopy(op["value"])
    elif kind == "replace":
        if isinstance(node, list):
            node[int(last)] = copy.deepcopy(op["value"])
        elif last not in node:
            raise ValueError(f"replace of a missing {op['path']}")
        else:
            node[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del node[int(last) if isinstance(node, list) else last]
    else:
        raise ValueError(f"unsupported JSON patch op {kind!r}")


# ---- images -----------------------------------------------------------------------------


def _containers(o: dict) -> list[dict]:
    if o["kind"] not in WORKLOADS:
        return []
    spec = o["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _set_image(container: dict, image: dict) -> None:
    name, _, tag = container["image"].partition(":")
    if name != image["name"]:
        return
    name = image.get("newName", name)
    tag = image.get("newTag", tag)
    container["image"] = f"{name}:{tag}" if tag else name
