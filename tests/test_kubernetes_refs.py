"""The rendered manifests agree with each other and with the code they run.

Selectors find pods; Services, probes and NetworkPolicies name ports the
containers open; every ConfigMap, Secret and claim referred to exists with
the key asked for; each container's command is a Tandem entry point and its
arguments, with $(VAR)s expanded as the kubelet would, are accepted by that
entry point's own parser and config checks; the kubelet's SIGKILL comes
after the drain the arguments ask for; the autoscalers' targets and metrics
exist.
"""

from __future__ import annotations

import argparse
import importlib
import re

import pytest
import yaml
from k8s_manifests import (
    POD_FIELDS,
    POD_INDEX,
    ROOT,
    container_env,
    every_rendering,
    expand,
    named,
    of_kind,
    pod_labels,
    selects,
    workloads,
    workloads_selected,
)

from engine.cli_args import config_from_args
from gateway.config import from_args
from worker.main import parser as worker_parser

ENTRY_POINTS = {"gateway", "prefill_service", "decode_service"}
DRAIN_MARGIN_S = 10  # after the grace period: stop the servers, shut the engine down

RENDERINGS = every_rendering()
CASES = sorted(RENDERINGS)


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def ports_of(deployment: dict) -> dict[str | int, int]:
    """Name and number of every container port -> its number."""
    found: dict[str | int, int] = {}
    for c in containers(deployment):
        for p in c.get("ports", []):
            found[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                found[p["name"]] = p["containerPort"]
    return found


@pytest.mark.parametrize("case", CASES)
def test_selectors_find_pods(case):
    objects = RENDERINGS[case]
    for d in workloads(objects):
        sel = d["spec"]["selector"]["matchLabels"]
        assert sel.items() <= pod_labels(d).items(), d["metadata"]["name"]
    for kind in ("Service", "PodDisruptionBudget"):
        for o in of_kind(objects, kind):
            selector = o["spec"]["selector"]
            selector = selector if kind != "Service" else {"matchLabels": selector}
            assert len(workloads_selected(objects, selector)) == 1, o["metadata"]["name"]
    for policy in of_kind(objects, "NetworkPolicy"):
        spec = policy["spec"]
        targets = workloads_selected(objects, spec["podSelector"])
        assert targets, policy["metadata"]["name"]
        for rule in spec.get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert workloads_selected(objects, peer["podSelector"]), peer
            for port in rule.get("ports", []):
                for d in targets:  # a named port must exist on every pod it guards
                    assert port["port"] in ports_of(d), (policy["metadata"]["name"], port)
    for monitor in of_kind(objects, "ServiceMonitor"):
        services = [s for s in of_kind(objects, "Service")
                    if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert services, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["endpoints"]:
            for s in services:
                assert endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}


@pytest.mark.parametrize("case", CASES)
def test_services_and_probes_use_container_ports(case):
    objects = RENDERINGS[case]
    for s in of_kind(objects, "Service"):
        (d,) = workloads_selected(objects, {"matchLabels": s["spec"]["selector"]})
        for p in s["spec"]["ports"]:
            assert p["targetPort"] in ports_of(d), (s["metadata"]["name"], p)
    for d in workloads(objects):
        for c in containers(d):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe not in c:
                    continue
                handler = next(v for k, v in c[probe].items()
                               if k in ("grpc", "httpGet", "tcpSocket", "exec"))
                if "port" in handler:
                    assert handler["port"] in ports_of(d), (d["metadata"]["name"], probe)


@pytest.mark.parametrize("case", CASES)
def test_referenced_configmaps_secrets_and_claims_exist(case):
    objects = RENDERINGS[case]

    def has(kind: str, name: str, key: str | None = None) -> None:
        obj = named(objects, kind, name)
        assert obj is not None, f"{case}: {kind} {name} is referred to but not defined"
        if key is not None:
            assert key in {**obj.get("data", {}), **obj.get("stringData", {})}, (name, key)

    for d in workloads(objects):
        spec = d["spec"]["template"]["spec"]
        for v in spec.get("volumes", []):
            if "secret" in v:
                for item in v["secret"].get("items", [{}]):
                    has("Secret", v["secret"]["secretName"], item.get("key"))
            if "configMap" in v:
                has("ConfigMap", v["configMap"]["name"])
            if "persistentVolumeClaim" in v:
                has("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
        for c in containers(d):
            volumes = {v["name"] for v in spec.get("volumes", [])}
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes
            for source in c.get("envFrom", []):
                has("ConfigMap", source["configMapRef"]["name"])
            for e in c.get("env", []):
                for kind, ref in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                    r = e.get("valueFrom", {}).get(ref)
                    if r:
                        has(kind, r["name"], r["key"])
    for monitor in of_kind(objects, "ServiceMonitor"):
        for endpoint in monitor["spec"]["endpoints"]:
            creds = endpoint.get("authorization", {}).get("credentials")
            if creds:
                has("Secret", creds["name"], creds["key"])
    keys = named(objects, "Secret", "tandem-api-keys")["stringData"]
    lines = [ln.strip() for ln in keys["keys"].splitlines()]
    assert keys["metrics-key"] in lines, "Prometheus's key must be one the gateway accepts"


@pytest.mark.parametrize("case", CASES)
def test_containers_run_tandem_with_arguments_it_accepts(case, monkeypatch):
    objects = RENDERINGS[case]
    dockerfile = (ROOT.parent.parent / "Dockerfile").read_text()
    tandem = [d for d in workloads(objects)
              if containers(d)[0]["image"].split(":")[0] == "tandem"]
    assert {d["metadata"]["name"] for d in tandem} == {
        "tandem-gateway", "tandem-prefill", "tandem-decode"}
    for d in tandem:
        (c,) = containers(d)
        assert c["command"][:2] == ["python", "-m"] and c["command"][2] in ENTRY_POINTS
        module = c["command"][2]
        assert f"COPY {module} {module}" in dockerfile, f"the image lacks {module}"
        env = container_env(objects, c)
        args = [expand(a, env) for a in c["args"]]
        for name in ("REDIS_URL", "TANDEM_API_KEY", "TANDEM_API_KEY_FILE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        try:
            if module == "gateway":
                p = importlib.import_module("gateway.__main__").parser()
                _check_full_flag_names(args, p)
                parsed = p.parse_args(args)
                config = from_args(parsed)
                assert config.state_url == env["REDIS_URL"]
                grace = config.drain_grace_s
            else:
                main = importlib.import_module(f"{module}.__main__")
                p = worker_parser(main.DESCRIPTION, main.ROLES)
                _check_full_flag_names(args, p)
                parsed = p.parse_args(args)
                config_from_args(parsed)
                assert parsed.state_url == env["REDIS_URL"]
                assert parsed.advertise_host == "10.1.2.3", "workers must register their pod IP"
                grace = parsed.grace
        except SystemExit:
            pytest.fail(f"{case}: {module} refused its arguments {args}")
        _check_drain_fits(d, c, grace)


def _check_full_flag_names(args: list[str], parser: argparse.ArgumentParser) -> None:
    """argparse takes an unambiguous prefix of a flag; a manifest should not
    lean on that (a new flag could make it ambiguous)."""
    for a in args:
        if a.startswith("--"):
            assert a.split("=", 1)[0] in parser._option_string_actions, f"{a}: not a full flag"


def _check_drain_fits(deployment: dict, container: dict, grace: float) -> None:
    """The kubelet's SIGKILL must come after the preStop hook, the drain's
    grace period and the shutdown that follows it."""
    pre_stop = 0
    hook = container.get("lifecycle", {}).get("preStop")
    if hook:
        assert hook["exec"]["command"][0] == "sleep"
        pre_stop = int(hook["exec"]["command"][1])
    period = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert period >= pre_stop + grace + DRAIN_MARGIN_S, deployment["metadata"]["name"]
    liveness = container["livenessProbe"]
    if "grpc" in liveness:  # NOT_SERVING while draining: liveness must not kill the drain
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > grace + DRAIN_MARGIN_S


GROUP_CASES = [c for c in CASES if of_kind(RENDERINGS[c], "StatefulSet")]


def test_a_multinode_group_is_rendered():
    assert "overlays/nvidia-gpu-multinode" in GROUP_CASES
    assert "base+components/multinode-tp" in GROUP_CASES


@pytest.mark.parametrize("case", GROUP_CASES)
def test_tensor_parallel_groups_span_their_pods(case):
    """A StatefulSet is one worker whose tensor-parallel group spans its
    pods: pod N is node rank N of replicas; every pod finds pod 0 by its
    stable name on a headless Service that publishes it before it is ready;
    the pods start together, reach each other on every port, and each has
    the GPUs of its share of the ranks."""
    objects = RENDERINGS[case]
    for sts in of_kind(objects, "StatefulSet"):
        name, spec = sts["metadata"]["name"], sts["spec"]
        assert spec["podManagementPolicy"] == "Parallel", name  # the leader waits for the rest
        service = named(objects, "Service", spec["serviceName"])
        assert service["spec"]["clusterIP"] == "None", name
        assert service["spec"].get("publishNotReadyAddresses") is True, name
        assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(sts))
        (c,) = containers(sts)
        main = importlib.import_module(f"{c['command'][2]}.__main__")
        p = worker_parser(main.DESCRIPTION, main.ROLES)
        replicas = spec["replicas"]
        for index in range(replicas):
            env = container_env(objects, c, {**POD_FIELDS, POD_INDEX: str(index)})
            config = config_from_args(p.parse_args([expand(a, env) for a in c["args"]]))
            assert (config.node_rank, config.nnodes) == (index, replicas), name
            assert config.master_addr in (f"{name}-0.{spec['serviceName']}",
                                          f"{name}-0.{spec['serviceName']}.tandem.svc"), name
            assert config.master_port in ports_of(sts).values(), name
            gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
            if config.device.startswith("cuda"):
                assert gpus == config.ranks_per_node, f"{name}: a GPU per rank of the node"
        group_policies = [
            n for n in of_kind(objects, "NetworkPolicy")
            if selects(n["spec"]["podSelector"], pod_labels(sts))
            and any("ports" not in rule and any(selects(peer.get("podSelector", {"x": 1}),
                                                        pod_labels(sts))
                                                for peer in rule.get("from", []))
                    for rule in n["spec"].get("ingress", []))]
        assert group_policies, f"{name}: its pods must reach each other on every port"
    for scaler in of_kind(objects, "HorizontalPodAutoscaler") + of_kind(objects, "ScaledObject"):
        assert scaler["spec"]["scaleTargetRef"].get("kind", "Deployment") != "StatefulSet"


@pytest.mark.parametrize("case", CASES)
def test_autoscalers_target_workers_on_served_metrics(case):
    objects = RENDERINGS[case]
    hpas, scaled = of_kind(objects, "HorizontalPodAutoscaler"), of_kind(objects, "ScaledObject")
    assert not (hpas and scaled), "KEDA makes its own HPA: never both for one Deployment"
    adapter = yaml.safe_load((ROOT / "components/hpa/prometheus-adapter-values.yaml").read_text())
    max_seqs = int(named(objects, "ConfigMap", "tandem-engine")["data"]["TANDEM_MAX_NUM_SEQS"])
    for hpa in hpas:
        assert named(objects, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        for m in hpa["spec"]["metrics"]:
            name = m["pods"]["metric"]["name"]
            assert _adapter_serves(adapter, name), f"no adapter rule serves {name}"
            if name == "vllm_num_requests_running":
                assert int(m["pods"]["target"]["averageValue"]) == int(0.75 * max_seqs)
    for so in scaled:
        role = named(objects, "Deployment", so["spec"]["scaleTargetRef"]["name"])
        component = pod_labels(role)["app.kubernetes.io/component"]
        for trigger in so["spec"]["triggers"]:
            assert f'role="{component}"' in trigger["metadata"]["query"]
            if "num_requests_running" in trigger["metadata"]["query"]:
                assert float(trigger["metadata"]["threshold"]) == int(0.75 * max_seqs)


def _adapter_serves(adapter: dict, name: str) -> bool:
    for rule in adapter["rules"]["custom"]:
        series = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
        for source in series.split("|"):
            if re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"),
                      source) == name:
                return True
    return False
