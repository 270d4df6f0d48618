"""A worker started with ``--node-rank`` > 0: one of the other nodes of a
worker whose tensor-parallel group spans hosts (``--nnodes``).

It runs only its ranks' model shards (engine/parallel/node.py): the leader
(node rank 0) serves the worker's gRPC API, schedules and registers. Once
its ranks are in the group it serves the standard gRPC health service on
``--port`` (SERVING), so that the same probes watch every node of a group;
until then the port is closed. It ends when the leader does: exit code 0
when the leader stopped the group, 1 when the leader went away, refused the
node or never came.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket

from engine.config import EngineConfig
from engine.parallel.node import run_node
from rpc.server import GrpcServer

logger = logging.getLogger("worker")


async def serve_node(args: argparse.Namespace, config: EngineConfig) -> int:
    """The process's exit code."""
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
    server = None
    try:
        if joined.is_set():
            tls = args.tls
            server = GrpcServer(args.host, args.port, credentials=(
                tls.server_credentials(tls.ca_file) if tls.enabled else None))
            await server.start()
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
    return 0
