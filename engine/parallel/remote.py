"""The leader's side of the ranks on other nodes (``nnodes`` > 1).

The leader listens at ``master_addr:master_port``. A rank on another node
(engine/parallel/node.py) builds its shard, connects, and says hello: its
rank and the settings it resolved (``settings``). The leader compares them
with its own, answers with the group's rendezvous store and the number of
KV blocks, and the rank allocates its cache and says ready. The leader's
start waits for every rank, within ``tp_join_timeout``, so a worker never
serves (nor registers) with part of its model missing. From then on each
connection carries the commands a local follower gets down its pipe
(engine/parallel/wire.py) until the leader stops the group or a side goes
away; a rank whose connection closes between commands breaks the group at
once (``on_lost``) rather than at the next step.

NOTE: neither this channel nor the collectives are encrypted or
authenticated: keep the nodes of a group on a network only they reach (the
Kubernetes manifests' NetworkPolicy does).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from engine.config import EngineConfig, ModelConfig
from engine.errors import EngineUnusable
from engine.parallel.wire import WireError, encode_command, recv_frame, send_frame

logger = logging.getLogger("engine")

_HELLO_TIMEOUT_S = 30.0  # a connection that says nothing is not a rank of ours


def settings(config: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> dict:
    """What every rank of a group must agree on, as plain data (``config``
    resolved: a concrete dtype)."""
    quant = model_cfg.quantization
    return {
        "tensor_parallel_size": config.tensor_parallel_size, "nnodes": config.nnodes,
        "dtype": config.dtype, "kv_cache_dtype": config.cache.kv_cache_dtype,
        "block_size": config.cache.block_size, "quantization": config.quantization,
        "load_format": config.load_format, "seed": config.seed, "max_model_len": max_model_len,
        "architecture": model_cfg.architecture, "vocab_size": model_cfg.vocab_size,
        "hidden_size": model_cfg.hidden_size, "num_layers": model_cfg.num_layers,
        "num_heads": model_cfg.num_heads, "num_kv_heads": model_cfg.num_kv_heads,
        "intermediate_size": model_cfg.intermediate_size,
        "weights": None if quant is None else type(quant).__name__,
    }


class RemoteRanks:
    def __init__(self, config: EngineConfig, ranks: range, mine: dict,
                 on_lost: Callable[[str], None]) -> None:
        """Listen for ``ranks`` (those on other nodes); ``mine``: the leader's
        ``settings``; ``on_lost(message)``: a joined rank went away."""
        self.config = config
        self.ranks = ranks
        self.mine = mine
        self.on_lost = on_lost
        self.where = f"{config.master_addr}:{config.master_port}"
        self.conns: dict[int, socket.socket] = {}
        self.peers: dict[int, str] = {}
        self._closing = False
        self._listener: socket.socket | None = _listen(
            config.master_addr, config.master_port, time.monotonic() + config.tp_join_timeout)
        logger.info("tensor parallel: waiting at %s for ranks %d-%d of %d (nodes 1-%d)",
                    self.where, ranks[0], ranks[-1], config.tensor_parallel_size,
                    config.nnodes - 1)

    def wait_ready(self, store: str, num_blocks: int) -> None:
        """Return once every rank has said ready; raise (leaving nothing
        open) if one refuses, fails, or the time runs out."""
        deadline = time.monotonic() + self.config.tp_join_timeout
        try:
            while len(self.conns) < len(self.ranks):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(self._timeout_message())
                self._listener.settimeout(remaining)
                try:
                    conn, peer = self._listener.accept()
                except TimeoutError:
                    continue
                self._admit(conn, f"{peer[0]}:{peer[1]}", store, num_blocks, deadline)
        except BaseException:
            self.close()
            raise
        self._listener.close()  # a late or second copy of a rank finds nobody
        self._listener = None
        for rank, conn in self.conns.items():
            conn.settimeout(None)
            threading.Thread(target=self._watch, args=(rank, conn), daemon=True,
                             name=f"tandem-tp{rank}-watch").start()
        logger.info("tensor parallel: ranks %d-%d joined from %s", self.ranks[0],
                    self.ranks[-1], ", ".join(sorted(set(self.peers.values()))))

    def _admit(self, conn: socket.socket, peer: str, store: str, num_blocks: int,
               deadline: float) -> None:
        conn.settimeout(min(_HELLO_TIMEOUT_S, max(deadline - time.monotonic(), 0.1)))
        try:
            hello, _ = recv_frame(conn)
        except (OSError, WireError) as exc:  # a stranger or a port scan: not fatal
            logger.warning("tensor parallel: ignoring a connection from %s: %s", peer, exc)
            conn.close()
            return
        try:
            rank = self._check_hello(hello, peer)
            send_frame(conn, {"op": "welcome", "store": store, "num_blocks": num_blocks})
            conn.settimeout(max(deadline - time.monotonic(), 0.1))
            ready, _ = recv_frame(conn)
            if ready.get("op") != "ready":
                raise ValueError(f"tensor-parallel rank {rank} on {peer} failed to start: "
                                 f"{ready.get('error', ready)}")
        except ValueError as exc:
            _try_send(conn, {"op": "refused", "error": str(exc)})
            conn.close()
            raise
        except (OSError, WireError) as exc:
            conn.close()
            raise RuntimeError(f"tensor-parallel rank from {peer} went away while joining: "
                               f"{exc}") from None
        self.conns[rank] = conn
        self.peers[rank] = peer
        logger.info("tensor parallel: rank %d joined from %s", rank, peer)

    def _check_hello(self, hello: dict, peer: str) -> int:
        """The rank a hello names; ValueError (the leader's start fails: the
        rank would fail the same way again) if it cannot join."""
        rank = hello.get("rank")
        if hello.get("op") != "hello" or not isinstance(rank, int):
            raise ValueError(f"{peer} sent {hello!r}, not a tensor-parallel rank's hello")
        if hello.get("error"):
            raise ValueError(f"tensor-parallel rank {rank} on {peer} failed to start: "
                             f"{hello['error']}")
        if rank not in self.ranks:
            raise ValueError(f"{peer} says it is tensor-parallel rank {rank}; this leader "
                             f"waits for ranks {self.ranks[0]}-{self.ranks[-1]}")
        if rank in self.conns:
            raise ValueError(f"tensor-parallel rank {rank} joined twice ({self.peers[rank]} "
                             f"and {peer}): is --node-rank the same on two nodes?")
        theirs = hello.get("settings") or {}
        differ = [f"{k} {theirs.get(k)!r} there, {v!r} here"
                  for k, v in self.mine.items() if theirs.get(k) != v]
        if differ:
            raise ValueError(f"tensor-parallel rank {rank} on {peer} runs with other settings "
                             f"({'; '.join(differ)}): start every node with the same model "
                             "and engine flags")
        return rank

    def _timeout_message(self) -> str:
        missing = [r for r in self.ranks if r not in self.conns]
        per_node = self.config.ranks_per_node
        nodes = sorted({r // per_node for r in missing})
        return (f"tensor-parallel ranks {missing} (node {', '.join(map(str, nodes))}) did not "
                f"join at {self.where} within {self.config.tp_join_timeout:g} s: start "
                f"--node-rank N --nnodes {self.config.nnodes} --master-addr "
                f"{self.config.master_addr} --master-port {self.config.master_port} with the "
                "same model and engine flags on every other node")

    def send(self, command: tuple | None) -> None:
        """Hand every remote rank the command (``None``: stop)."""
        if command is None:
            self._closing = True  # their connections close next: not a loss
        header, payload = encode_command(command)
        for rank, conn in self.conns.items():
            try:
                send_frame(conn, header, payload)
            except OSError as exc:
                raise EngineUnusable(f"tensor-parallel rank {rank} on {self.peers[rank]} is "
                                     f"gone ({exc})") from None

    def _watch(self, rank: int, conn: socket.socket) -> None:
        """A rank never writes after joining: anything from it, or the end
        of its connection, means it is gone."""
        try:
            data = conn.recv(1)
            why = "its connection closed" if not data else "it broke the protocol"
        except OSError as exc:
            why = str(exc)
        if not self._closing:
            self.on_lost(f"tensor-parallel rank {rank} on {self.peers[rank]} is gone ({why})")

    def close(self) -> None:
        """Drop every connection (a rank still running sees its leader go
        away, and exits). Idempotent."""
        self._closing = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in self.conns.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self.conns.clear()


def _listen(host: str | None, port: int, deadline: float) -> socket.socket:
    while True:
        # NOTE: a name may resolve a little after the host comes up (the DNS
        # record of a Kubernetes pod that is not ready yet): keep asking.
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            break
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                raise ValueError(f"master_addr {host!r} does not resolve ({exc})") from None
            logger.warning("tensor parallel: master_addr %r does not resolve yet (%s)", host, exc)
            time.sleep(2.0)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"the leader (node rank 0) cannot listen at {host}:{port} ({exc.strerror}): "
            "master_addr must be an address of this host and master_port free on it"
        ) from None
    return sock


def _try_send(conn: socket.socket, header: dict) -> None:
    try:
        send_frame(conn, header)
    except OSError:
        pass
