"""``tandem up``: a gateway with prefill and decode workers on this machine.

    tandem up --prefill 1 --decode 1 --port 8000

``--prefill 0`` runs colocated workers (each does prefill and decode).
Prints the URL and a ready-to-paste curl line; Ctrl-C stops everything.
A worker that exits is reported and the rest go on serving (the gateway
moves its requests); the cluster stops once no gateway or no decode worker
is left.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from engine.config import DTYPE_CHOICES, CacheConfig, EngineConfig, default_of
from gateway.disagg_policy import POLICIES
from tandem.cluster import LocalCluster
from worker.cpu_cores import placement_flags, split_cores


def up_args(**overrides) -> argparse.Namespace:
    """``tandem up``'s arguments as its flags' defaults give them, with
    ``overrides``: for callers that start a cluster from code."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["up"])
    for name, value in overrides.items():
        if not hasattr(args, name):
            raise ValueError(f"tandem up has no option {name!r}")
        setattr(args, name, value)
    return args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a local cluster: gateway + prefill + decode workers",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: colocated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="REST port of the gateway")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port of the gateway")
    # NOTE: mooncake by default: on one host it moves a burst's KV without
    # Python in the way (64 x 128-token prompts: 676 tok/s and 1.06 s TTFT
    # p50 against grpc's 613 and 1.61 s; docs/benchmarks.md).
    p.add_argument("--transport", default="mooncake", choices=["grpc", "torch", "mooncake"],
                   help="KV transport (default mooncake; its workers fall back to grpc, "
                        "logged and counted, where it cannot start)")
    p.add_argument("--disagg-policy", default=None, choices=POLICIES,
                   help="where each prompt is computed: always on a prefill worker, never "
                        "(on the decode worker), or auto (a cost model; gateway/disagg_policy.py); "
                        "default: the gateway's")
    p.add_argument("--state-url", default=None,
                   help="Redis URL (default: the gateway's in-process store)")
    p.add_argument("--kv-cache-gib", type=float,
                   default=default_of(CacheConfig, "kv_cache_bytes") / (1 << 30),
                   help="KV cache per worker on the CPU, in GiB")
    p.add_argument("--dtype", default=default_of(EngineConfig, "dtype"), choices=DTYPE_CHOICES,
                   help="auto: bfloat16 where the hardware has it natively, else float32")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length for the workers and the gateway alike (default: the "
                        "model's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve each worker's Prometheus /metrics from this port on: "
                        "prefill workers first, then decode workers (BASE, BASE+1, ...)")
    p.add_argument("--lend-cores", action=argparse.BooleanOptionalAction, default=True,
                   help="workers compute on each other's cores while the owner idles, a step "
                        "at a time (default: on; each still owns its share of the cores)")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag passed to every worker (repeatable)")
    p.set_defaults(run=run)


def start_cluster(args: argparse.Namespace, cluster: LocalCluster):
    """Start workers then the gateway; returns the gateway process."""
    model = ["--model", args.model] if args.model else []
    common = [*model, "--host", args.host, "--port", "0", "--dtype", args.dtype,
              "--kv-cache-gib", str(args.kv_cache_gib), *args.worker_arg]
    if args.state_url:
        common += ["--state-url", args.state_url]
    length = [] if args.max_model_len is None else ["--max-model-len", str(args.max_model_len)]
    common += length
    decode_role = "decode" if args.prefill > 0 else "both"
    # Each worker its own cores, unless the user placed them (or there are
    # fewer cores than workers): full OpenMP teams side by side stall each other.
    cores = None if any(a.startswith("--cpu-cores") for a in args.worker_arg) \
        else split_cores(args.prefill + args.decode)
    flags = None if cores is None else placement_flags(cores, args.lend_cores)

    def placed(i: int) -> list[str]:
        cpu = [] if flags is None else flags[i]
        return cpu + ([] if args.metrics_port is None
                      else ["--metrics-port", str(args.metrics_port + i)])

    worker_transports = "mooncake,grpc" if args.transport == "mooncake" else args.transport
    # Every worker starts at once: their start-ups overlap.
    roles = ["prefill"] * args.prefill + [decode_role] * args.decode
    workers = cluster.start_all([
        (role, [*common, "--transport", worker_transports, *placed(i)])
        for i, role in enumerate(roles)])
    prefills, decodes = workers[:args.prefill], workers[args.prefill:]
    gateway_args = [*model, "--host", args.host, "--port", str(args.port),
                    "--grpc-port", str(args.grpc_port), "--transport", args.transport, *length]
    if args.disagg_policy:
        gateway_args += ["--disagg-policy", args.disagg_policy]
    for p in prefills:
        gateway_args += ["--prefill", p.address]
    for d in decodes:
        gateway_args += ["--decode", d.address]
    if args.state_url:
        gateway_args += ["--state-url", args.state_url]
    if args.api_key:
        gateway_args += ["--api-key", args.api_key]
    return cluster.start("gateway", gateway_args)


def run(args: argparse.Namespace) -> int:
    from gateway.service import default_model_name  # here: `tandem --help` stays light

    if args.decode < 1 or args.prefill < 0:
        raise ValueError("need at least one decode worker and no negative counts")
    stop = threading.Event()
    # A closed terminal (SIGHUP) stops the cluster as Ctrl-C and SIGTERM do.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    with LocalCluster(echo=False) as cluster:
        print(f"starting {args.prefill} prefill + {args.decode} decode worker(s)...",
              flush=True)
        gateway = start_cluster(args, cluster)
        url = f"http://{gateway.address}"
        body = json.dumps({"model": default_model_name(args.model), "max_tokens": 32, "messages": [
            {"role": "user", "content": "What is the capital of France?"}]})
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
        print(f"\nTandem is serving at {url} (gRPC {gateway.extra.get('grpc')})\n\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
              f"-d '{body}'\n", flush=True)
        if args.metrics_port is not None:
            roles = [("prefill", i) for i in range(args.prefill)] + \
                [("decode", i) for i in range(args.decode)]
            for port, (role, i) in enumerate(roles, start=args.metrics_port):
                print(f"  {role} worker {i} metrics: http://{args.host}:{port}/metrics",
                      flush=True)
        print("Ctrl-C stops it.", flush=True)
        try:
            reported: set[int] = set()
            while not stop.wait(0.5):
                for proc in cluster.procs:
                    if not proc.alive and id(proc) not in reported:
                        reported.add(id(proc))
                        print(f"{proc.role} process exited:\n{proc.output()[-2000:]}",
                              file=sys.stderr, flush=True)
                # NOTE: a worker's death is not the cluster's: the gateway
                # moves its requests to the others (docs/architecture.md). Only
                # without a gateway or any decode worker is nothing served.
                if not gateway.alive or not any(
                        p.alive for p in cluster.procs if p.role in ("decode", "both")):
                    return 1
        except KeyboardInterrupt:
            pass
        print("stopping...", flush=True)
    return 0
