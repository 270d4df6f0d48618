"""A follower node of a tensor-parallel group spread over hosts: the ranks
``node_rank * n .. node_rank * n + n - 1`` (n = tensor_parallel_size /
nnodes), each holding its shard of the model and taking part in every step
the leader (node 0) runs; no scheduler, no requests, no service of its own.

Each rank builds its shard first (every node loads at once), then reaches
the leader at ``master_addr:master_port``, retrying until
``tp_join_timeout`` while the leader starts; says hello with the settings it
resolved; gets the group's store and the number of KV blocks; allocates its
cache, says ready and joins the group (engine/parallel/remote.py is the
other side). Then it carries out the leader's commands until the leader
stops the group (``run_node`` returns) or goes away (``LeaderGone``: the
node is of no use without it, and its supervisor restarts it to wait for
the next leader).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import socket
import time
from collections.abc import Callable

from engine.config import EngineConfig
from engine.device import claim_device, comm_backend, rank_device
from engine.model_shard import ModelShard
from engine.parallel.followers import run_command
from engine.parallel.group import TensorParallel
from engine.parallel.remote import settings
from engine.parallel.wire import WireError, decode_command, recv_frame, send_frame
from engine.resolved import resolve_model

logger = logging.getLogger("engine")


class LeaderGone(RuntimeError):
    """The leader refused this node's ranks, never answered, or went away."""


def run_node(config: EngineConfig, on_joined: Callable[[], None] = lambda: None) -> None:
    """Run this node's ranks until the leader stops the group. ``on_joined``
    once they are in the group. Raises LeaderGone (or what failed) otherwise."""
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError("run_node runs the ranks of node 1.. of a group with nnodes > 1")
    first, *others = config.node_ranks
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_process, args=(config, rank), daemon=True,
                         name=f"tandem-tp{rank}") for rank in others]
    for proc in procs:
        proc.start()
    try:
        # NOTE: one rank joined means all did (the group forms only whole).
        _run_rank(config, first, on_joined)
    finally:
        for proc in procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    failed = [p for p in procs if p.exitcode]
    if failed:
        raise RuntimeError(f"{failed[0].name} exited with code {failed[0].exitcode}")


def _rank_process(config: EngineConfig, rank: int) -> None:
    logging.basicConfig(level=logging.INFO)
    try:
        _run_rank(config, rank, lambda: None)
    except Exception as exc:
        logger.error("tensor-parallel rank %d: %s", rank, exc)
        raise SystemExit(1) from None


def _run_rank(config: EngineConfig, rank: int, on_joined: Callable[[], None]) -> None:
    local = rank - config.node_ranks[0]
    config = dataclasses.replace(config, device=rank_device(config.device, local))
    tp = TensorParallel(rank, config.tensor_parallel_size)
    shard, mine, error = None, None, None
    try:  # a failure here is told to the leader, so that its start fails with the reason
        claim_device(config.device, config.ranks_per_node)
        resolved = resolve_model(config)
        mine = settings(resolved.config, resolved.model_config, resolved.max_model_len)
        shard = ModelShard(resolved.config, resolved.model_config, resolved.model_dir,
                           resolved.max_model_len, tp)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    where = f"{config.master_addr}:{config.master_port}"
    deadline = time.monotonic() + config.tp_join_timeout
    conn = _connect(config, deadline)
    try:
        conn.settimeout(max(deadline - time.monotonic(), 0.1))
        send_frame(conn, {"op": "hello", "rank": rank, "settings": mine, "error": error,
                          "host": socket.gethostname()})
        if error is not None:
            raise RuntimeError(f"tensor-parallel rank {rank} could not start: {error}")
        try:
            welcome, _ = recv_frame(conn)
        except (OSError, WireError) as exc:
            raise LeaderGone(f"the leader at {where} did not welcome rank {rank}: {exc}") from None
        if welcome.get("op") != "welcome":
            raise LeaderGone(f"the leader at {where} refused rank {rank}: "
                             f"{welcome.get('error', welcome)}")
        try:
            shard.allocate_cache(int(welcome["num_blocks"]))
        except Exception as exc:
            send_frame(conn, {"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
            raise
        send_frame(conn, {"op": "ready"})
        tp.join(welcome["store"], comm_backend(config.device))
        logger.info("tensor parallel: rank %d joined the group at %s", rank, where)
        on_joined()
        conn.settimeout(None)
        _follow_commands(conn, shard, tp, where)
    finally:
        tp.leave()
        conn.close()


def _follow_commands(conn: socket.socket, shard: ModelShard, tp: TensorParallel,
                     where: str) -> None:
    while True:
        try:
            command = decode_command(*recv_frame(conn))
        except (OSError, WireError) as exc:
            raise LeaderGone(f"the leader at {where} went away ({exc}); the ranks of this "
                             "node cannot run without it") from None
        if command is None:
            logger.info("tensor parallel: the leader at %s stopped the group", where)
            return
        try:
            run_command(shard, tp, command)
        except Exception as exc:  # a collective whose peer is gone, mostly
            raise LeaderGone(f"a tensor-parallel {command[0]} failed ({exc}): the leader at "
                             f"{where} or another rank is gone") from exc


def _connect(config: EngineConfig, deadline: float) -> socket.socket:
    """A connection to the leader, tried again until ``deadline`` (it may
    still be loading its own shard)."""
    host, port = config.master_addr, config.master_port
    waiting = False
    while True:
        try:
            return socket.create_connection(
                (host, port), timeout=max(min(10.0, deadline - time.monotonic()), 0.1))
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LeaderGone(
                    f"no leader answered at {host}:{port} within {config.tp_join_timeout:g} s "
                    f"({exc}): start node rank 0 with --nnodes {config.nnodes} --master-addr "
                    f"{host} --master-port {port}"
                ) from None
            if not waiting:
                logger.info("tensor parallel: waiting for the leader at %s:%d (%s)",
                            host, port, exc)
                waiting = True
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
