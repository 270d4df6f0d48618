"""Ranks 1..N-1 of a tensor-parallel engine.

Those on the leader's node are spawned processes; each builds its
``ModelShard``, says whether that worked, joins the group, then carries out
the commands rank 0 sends down its pipe until it sends ``None``. Those on
other nodes (``nnodes`` > 1) get the same commands over the network
(engine/parallel/remote.py, node.py). The commands: ``("forward", StepBatch, logit_calls)`` (its
layers take part in the all-reduces, its slice of the vocabulary in each
logits gather), ``("read_kv", block_ids, layer)`` (its heads of
those blocks, gathered to rank 0) and ``("write_kv", block_ids, layer)``
(its share, scattered from rank 0). Rank 0 alone schedules, samples and
owns the requests.

Commands travel over a pipe, not a collective: a follower may wait for the
next one as long as the engine idles, while a collective would time out.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import queue
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

from engine.config import EngineConfig, ModelConfig
from engine.device import claim_device, comm_backend, rank_device
from engine.errors import EngineUnusable
from engine.model_shard import ModelShard
from engine.parallel.group import TensorParallel
from engine.parallel.remote import RemoteRanks, settings
from engine.parallel.sharded_kv import read_local, write_local

logger = logging.getLogger("engine")

_READY_TIMEOUT_S = 600.0  # loading a large shard from a slow disk


class Followers:
    """Ranks 1..size-1, started (on this node) and awaited by rank 0."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model_dir: Path,
                 max_model_len: int, num_blocks: int, tp: TensorParallel, address: str) -> None:
        """``address``: the rendezvous store rank 0 hosts (``TensorParallel.host``)."""
        size = tp.size
        ctx = mp.get_context("spawn")
        self._ready = ctx.Queue()
        self.procs: list[BaseProcess] = []  # this node's
        self._commands = []
        self._store, self._num_blocks = address, num_blocks
        # The other nodes' ranks: listening for them from now, while ours load.
        self.remote: RemoteRanks | None = None
        if config.nnodes > 1:
            self.remote = RemoteRanks(
                config, range(config.ranks_per_node, size),
                settings(config, model_cfg, max_model_len),
                on_lost=lambda message: tp.fail(EngineUnusable(message)))
        for rank in range(1, config.ranks_per_node):
            rank_config = dataclasses.replace(config, device=rank_device(config.device, rank))
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_follow, name=f"tandem-tp{rank}", daemon=True,
                args=(rank_config, model_cfg, model_dir, max_model_len, num_blocks, rank, size,
                      address, self._ready, receive),
            )
            proc.start()
            receive.close()  # the follower's end
            self.procs.append(proc)
            self._commands.append(send)

    def send(self, command: tuple | None) -> None:
        """Hand every follower the next command (``None``: exit). The caller
        holds the group's lock through the command's collectives."""
        for conn, proc in zip(self._commands, self.procs):
            try:
                conn.send(command)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise EngineUnusable(
                    f"tensor-parallel {proc.name} is gone (exit code {proc.exitcode})"
                ) from None
        if self.remote is not None:
            self.remote.send(command)

    def wait_ready(self) -> None:
        """Return once every follower has built its shard (and, on other
        nodes, joined within ``tp_join_timeout``); raise the first
        follower's error (and stop the rest) otherwise."""
        self._wait_local()
        if self.remote is not None:
            try:
                self.remote.wait_ready(self._store, self._num_blocks)
            except BaseException:
                self.kill()
                raise

    def _wait_local(self) -> None:
        pending = {p.name for p in self.procs}
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while pending:
            try:
                name, error = self._ready.get(timeout=1.0)
            except queue.Empty:
                dead = next((p for p in self.procs if p.name in pending and not p.is_alive()),
                            None)
                if dead is not None:
                    self.kill()
                    raise RuntimeError(
                        f"{dead.name} exited with code {dead.exitcode} while loading its shard"
                    ) from None
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(
                        f"{', '.join(sorted(pending))} did not load within "
                        f"{_READY_TIMEOUT_S:.0f} s"
                    ) from None
                continue
            if error is not None:
                self.kill()
                raise ValueError(f"{name}: {error}")
            pending.discard(name)

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the followers to exit (after ``send(None)``)."""
        for proc in self.procs:
            proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for conn in self._commands:
            conn.close()
        if self.remote is not None:
            self.remote.close()


def _follow(config: EngineConfig, model_cfg: ModelConfig, model_dir: Path, max_model_len: int,
            num_blocks: int, rank: int, size: int, address: str, ready, commands) -> None:
    name = mp.current_process().name
    tp = TensorParallel(rank, size)
    try:
        claim_device(config.device, config.ranks_per_node)
        shard = ModelShard(config, model_cfg, model_dir, max_model_len, tp)
        shard.allocate_cache(num_blocks)
    except Exception as exc:  # reported to rank 0, which raises it
        ready.put((name, f"{type(exc).__name__}: {exc}"))
        return
    ready.put((name, None))
    tp.join(address, comm_backend(config.device))
    try:
        while (command := _next(commands)) is not None:
            run_command(shard, tp, command)
    finally:
        tp.leave()


def run_command(shard: ModelShard, tp: TensorParallel, command: tuple) -> None:
    """A follower's part of one command from rank 0 (any node)."""
    kind, *args = command
    if kind == "forward":
        batch, logit_calls = args
        shard.forward(batch, logit_calls)
    elif kind == "read_kv":
        tp.gather(read_local(shard.blocks, *args))
    elif kind == "write_kv":
        block_ids, layer = args
        num_layers = len(shard.kv_caches) if layer is None else None
        out = shard.blocks.empty(num_layers, len(block_ids))
        write_local(shard.blocks, block_ids, layer, tp.scatter(out))
    else:
        raise RuntimeError(f"unknown tensor-parallel command {kind!r}")


def _next(commands) -> tuple | None:
    try:
        return commands.recv()
    except EOFError:  # rank 0 is gone
        return None
