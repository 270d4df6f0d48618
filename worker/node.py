"""A worker started with ``--node-rank`` > 0: one of the other nodes of a
worker whose tensor-parallel group spans hosts (``--nnodes``).

It runs only its ranks' model shards (engine/parallel/node.py): the leader
(node rank 0) serves the worker's gRPC API, schedules and registers. Once
its ranks are in the group it serves the standard gRPC health service on
``--port`` (SERVING) and, with ``--metrics-port``, a /metrics of its own
(``tandem:tp_node_joined``), so that the same probes and scrapes watch
every node of a group; until then both ports are closed.

It ends when the leader does: exit code 0 when the leader stopped the group,
1 when the leader went away, refused the node or never came. A SIGTERM
after joining does not end it: the leader, told to stop at the same time
(a rollout, a deleted group), drains first and needs every rank for the
steps of that drain; it then stops the group, and this node exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from engine.config import EngineConfig
from engine.parallel.node import run_node
from rpc.server import GrpcServer
from worker.cpu_cores import format_cores, pin_to_cores

logger = logging.getLogger("worker")


async def serve_node(args: argparse.Namespace, config: EngineConfig) -> int:
    """The process's exit code."""
    if args.cpu_cores is not None:
        logger.info("computing on cores %s", format_cores(pin_to_cores(args.cpu_cores)))
    loop = asyncio.get_running_loop()
    joined = asyncio.Event()
    ranks = config.node_ranks
    logger.info("node %d of %d: tensor-parallel ranks %d-%d of %d; the leader is at %s:%d",
                config.node_rank, config.nnodes, ranks[0], ranks[-1],
                config.tensor_parallel_size, config.master_addr, config.master_port)
    running = loop.run_in_executor(None, run_node, config,
                                   lambda: loop.call_soon_threadsafe(joined.set))
    waiting = asyncio.ensure_future(joined.wait())
    await asyncio.wait([running, waiting], return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    server = metrics = None
    try:
        if joined.is_set():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, _stay, config)
            tls = args.tls
            server = GrpcServer(args.host, args.port, credentials=(
                tls.server_credentials(tls.ca_file) if tls.enabled else None))
            await server.start()
            if args.metrics_port is not None:
                metrics = _serve_metrics(args, config)
            node_id = args.worker_id or f"{args.role}-{socket.gethostname()}-node{config.node_rank}"
            # Launchers and tests wait for this line, as for a worker's.
            print(f"TANDEM_READY node {node_id} {args.advertise_host or args.host}:{server.port}",
                  flush=True)
        await running
    except Exception as exc:
        logger.error("node %d: %s", config.node_rank, exc)
        return 1
    finally:
        if server is not None:
            await server.stop(grace=1.0)
        if metrics is not None:
            metrics.shutdown()
    return 0


def _stay(config: EngineConfig) -> None:
    logger.info("node %d: signal received; running until the leader at %s:%d stops the group "
                "(it drains first)", config.node_rank, config.master_addr, config.master_port)


def _serve_metrics(args: argparse.Namespace, config: EngineConfig):
    registry = CollectorRegistry()
    joined = Gauge("tandem:tp_node_joined",
                   "1 while this node's tensor-parallel ranks are in their leader's group",
                   ["node_rank"], registry=registry)
    joined.labels(node_rank=str(config.node_rank)).set(1)
    server, _ = start_http_server(args.metrics_port, addr=args.host, registry=registry)
    return server
