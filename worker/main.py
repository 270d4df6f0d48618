"""Process start-up shared by both workers: flags, engine, gRPC server,
/metrics, registration, and a graceful drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.async_engine import AsyncEngineLoop
from engine.cli_args import add_engine_args, config_from_args
from engine.core_lease import CoreLease
from engine.llm_engine import LLMEngine
from engine.openmp import serial_thread
from engine.warmup import warm_up
from kv_transfer.mooncake_endpoint import PROTOCOLS
from rpc import event_loop
from rpc.logs import setup_logging
from rpc.parent_death import die_with_parent
from rpc.protos import worker_pb2, worker_pb2_grpc
from rpc.server import GrpcServer, serve_until_signal
from rpc.tls import add_tls_arguments, tls_from_args
from rpc.tracing import setup_tracing
from worker.base import WorkerBase
from worker.cpu_cores import (
    check_available,
    default_lock_dir,
    format_cores,
    parse_cores,
    pin_to_cores,
)
from worker.node import serve_node
from worker.peers import PeerPolicy
from worker.registry import Registration
from worker.servicer import WorkerServicer
from worker.transports import TransportConfig

logger = logging.getLogger("worker")

# How long a prefill worker with a backlog waits, at the start of a step, for
# a busy neighbour to lend its cores: a decode step of a full batch or two.
PREFILL_LEASE_WAIT_S = 0.5

# (engine, worker id, address, flags, **WorkerBase keywords: tls, peers, transports)
WorkerFactory = Callable[..., WorkerBase]


def parser(description: str, roles: list[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    add_engine_args(p)
    g = p.add_argument_group("worker")
    g.add_argument("--role", default=roles[0], choices=roles)
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (0.0.0.0: every interface, only when asked)")
    g.add_argument("--advertise-host", default=None,
                   help="host other processes reach this worker at (default: --host)")
    g.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    g.add_argument("--worker-id", default=None)
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics here (0: a free port, named in the ready line)")
    g.add_argument("--state-url", default=os.environ.get("REDIS_URL"),
                   help="Redis URL to register in (default: $REDIS_URL; none: no registration)")
    g.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                   help="a worker this one may connect to (repeatable); with --state-url, "
                        "registered workers are allowed too; with neither, any")
    g.add_argument("--grace", type=float, default=10.0, help="seconds to drain on SIGTERM")
    g.add_argument("--transport", default="grpc", metavar="LIST",
                   help="KV transports to run, in order of preference, e.g. mooncake,grpc "
                        "(grpc, torch, mooncake): one that cannot start is skipped with a "
                        "warning and the next stands in; the first is a prefill worker's "
                        "default. A decode worker runs mooncake only when listed")
    g.add_argument("--mooncake-protocol", default="tcp", choices=list(PROTOCOLS),
                   help="the mooncake transport's protocol: tcp anywhere, rdma with an RDMA NIC")
    g.add_argument("--mooncake-device", default="",
                   help="RDMA NIC(s) for --mooncake-protocol rdma, e.g. mlx5_0 (default: any)")
    g.add_argument("--kv-layer-writes", "--mooncake-layer-writes", dest="kv_layer_writes",
                   default="auto", choices=["auto", "on", "off"],
                   help="on: over mooncake or torch, a prefill worker sends each layer's KV "
                        "as soon as the layer computed it, overlapping the later layers' "
                        "compute; off: one send when the prompt is done; auto (default): on "
                        "when the KV cache is on a GPU (on a CPU the sends would share its "
                        "cores). --mooncake-layer-writes is its older name")
    g.add_argument("--mooncake-cores", default=None, metavar="LIST",
                   help="run the mooncake engine's threads on these cores only, e.g. a spare "
                        "core beside --cpu-cores (default: wherever this worker may run; on "
                        "a 2-core host that was faster under load than the worker's own core)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="before serving, run one full step of made-up prompts and a decode "
                        "step (engine/warmup.py): the first requests then do not pay the "
                        "engine's one-time costs")
    g.add_argument("--log-format", default="plain", choices=["plain", "json"])
    g.add_argument("--cpu-cores", default=None, metavar="LIST",
                   help="compute only on these cores, e.g. 0-3 (one torch thread each); "
                        "give workers that share a host disjoint lists")
    g.add_argument("--borrow-cores", default=None, metavar="LIST",
                   help="with --cpu-cores: also compute on these cores (other workers' on "
                        "this host, e.g. 0-3) while their owners idle, a step at a time; "
                        "every worker of the host should list the same cores")
    g.add_argument("--core-lock-dir", default=None, metavar="DIR",
                   help="where the workers lending each other cores keep their locks "
                        "(default: a directory per user in the system's temp dir)")
    add_tls_arguments(p)
    return p


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _mooncake_cores(args: argparse.Namespace) -> tuple[int, ...]:
    """``--mooncake-cores`` as a tuple (empty: not given). ValueError for a
    bad list or cores this process may not use."""
    if args.mooncake_cores is None:
        return ()
    return tuple(check_available(parse_cores(args.mooncake_cores), "--mooncake-cores: cores"))


def run(make_worker: WorkerFactory, description: str, roles: list[str],
        argv: list[str] | None = None) -> None:
    die_with_parent()
    p = parser(description, roles)
    args = p.parse_args(argv)
    try:  # bad flags, TLS files or peers end the start-up here, before the model loads
        config = config_from_args(args)
        args.tls = tls_from_args(args)
        args.peers = PeerPolicy(args.peer, args.state_url)
        args.transports = TransportConfig.parse(
            args.transport, host=args.advertise_host or args.host,
            mooncake_protocol=args.mooncake_protocol, mooncake_device=args.mooncake_device,
            kv_layer_writes=args.kv_layer_writes,
            mooncake_cores=_mooncake_cores(args))
    except ValueError as exc:
        p.error(str(exc))
    if args.borrow_cores is not None and args.cpu_cores is None:
        p.error("--borrow-cores needs --cpu-cores: the cores this worker owns and lends")
    if args.tls.enabled and not args.tls.mutual:
        p.error("a worker's TLS is mTLS: give --tls-ca-file too (peers are checked against it)")
    if config.nnodes > 1 and args.tls.enabled and not args.tls.allow_torch_transport:
        p.error("--nnodes > 1 under TLS: the ranks' traffic between nodes is neither encrypted "
                "nor authenticated; add --tls-allow-torch-transport on a trusted network")
    setup_logging(args.log_format)
    if config.node_rank > 0:  # another node's ranks of the leader's group: no API of its own
        raise SystemExit(event_loop.run(serve_node(args, config)))
    setup_tracing(f"tandem-{args.role}")
    event_loop.run(serve(make_worker, args))


async def serve(make_worker: WorkerFactory, args: argparse.Namespace) -> None:
    lease = None
    if args.cpu_cores is not None:
        cores = pin_to_cores(args.cpu_cores, args.borrow_cores)
        logger.info("computing on cores %s", format_cores(cores))
        if args.borrow_cores:
            # A prefill worker's queue is its requests' time to first token:
            # with a backlog it waits for a busy decode neighbour to lend its
            # cores for a step (engine/core_lease.py).
            lease = CoreLease(cores, parse_cores(args.borrow_cores),
                              args.core_lock_dir or default_lock_dir(),
                              wait_s=PREFILL_LEASE_WAIT_S if args.role == "prefill" else 0.0)
            logger.info("borrowing cores %s while their owners idle",
                        format_cores(lease.others) or "(none besides its own)")
    config = config_from_args(args)
    if args.role == "prefill" and config.speculative_config is not None:
        # NOTE: a prefill worker samples one token per request: nothing to
        # speculate on. The flag is accepted so one command line serves both roles.
        logger.info("prefill worker: --speculative-config ignored")
        config = dataclasses.replace(config, speculative_config=None)
    def build() -> LLMEngine:
        engine = LLMEngine(config)
        if args.warmup:
            # As a step under the core lease: on this worker's own cores and
            # any an idle neighbour lends, not on a busy neighbour's.
            with contextlib.nullcontext() if lease is None else lease.step():
                warm_up(engine)
        return engine

    # Built on the thread that steps it, the only one that computes in
    # parallel: one OpenMP team in this process (engine/openmp.py).
    aengine = AsyncEngineLoop(build, lease)
    serial_thread()
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(thread_name_prefix="worker-io", initializer=serial_thread))
    tls = args.tls
    # A worker's callers are the gateway and other workers: all show a
    # certificate the CA signed (mTLS).
    server = GrpcServer(args.host, args.port,
                        credentials=tls.server_credentials(tls.ca_file) if tls.enabled else None)
    host = args.advertise_host or args.host
    worker_id = args.worker_id or f"{args.role}-{socket.gethostname()}-{server.port}"
    address = f"{host}:{server.port}"
    worker = make_worker(aengine, worker_id, address, args, tls=tls, peers=args.peers,
                         transports=args.transports)
    if args.peers.open and not _loopback(args.host):
        logger.warning("no --peer and no --state-url: this worker connects to any peer a call "
                       "names; let only the gateway reach it (or use mTLS)")
    if tls.enabled and tls.allow_torch_transport:
        logger.warning("--tls-allow-torch-transport: KV over the torch and mooncake transports "
                       "is neither encrypted nor authenticated; keep the workers on a trusted "
                       "network")
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(worker), server.server)
    server.add_service(worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name)
    registration = Registration(args.state_url, worker) if args.state_url else None
    metrics_server = None

    async def start() -> None:
        nonlocal metrics_server
        await server.start()
        if args.metrics_port is not None:
            from prometheus_client import start_http_server

            metrics_server, _ = start_http_server(args.metrics_port, addr=args.host,
                                                  registry=worker.metrics.registry)
        if registration is not None:
            await registration.start()
        # Launchers and tests wait for this line.
        metrics = ("" if metrics_server is None
                   else f" metrics={args.host}:{metrics_server.server_port}")
        print(f"TANDEM_READY {worker.role} {worker_id} {address}{metrics}", flush=True)
        logger.info("%s worker %s serving on %s%s", worker.role, worker_id, address,
                    " (mTLS)" if tls.enabled else "")

    async def drain() -> None:
        await server.set_serving(False)
        # NOTE: registered until the drain ends. Its Info says "draining" at
        # once, so the gateway sends it nothing new; a registration gone
        # missing would make the gateway move its streams before --grace.
        await worker.drain(args.grace)
        if registration is not None:
            await registration.stop()
        await server.stop(grace=1.0)
        await worker.close()
        if metrics_server is not None:
            metrics_server.shutdown()

    if await serve_until_signal(start, drain, broken=worker.aengine.unusable):
        # A supervisor (docker-compose, Kubernetes) restarts the worker.
        raise SystemExit(1)
