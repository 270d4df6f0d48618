"""This process's place in a tensor-parallel group.

Passed explicitly to the layers that need it (no module globals). With one
rank every method is free: ``all_reduce`` returns its input untouched.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from engine.errors import EngineUnusable
from engine.parallel.store import listening_store

# How long a rank waits in a collective for the others: long enough for a
# slow first step, short enough that a dead rank surfaces as an error.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


class TensorParallel:
    def __init__(self, rank: int = 0, size: int = 1) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} of {size} is not valid")
        self.rank = rank
        self.size = size
        # Rank 0 holds it from sending a command to the command's last
        # collective, so commands from two threads (a step, a KV copy) never
        # interleave their collectives.
        self.lock = threading.Lock()
        self._store: dist.TCPStore | None = None  # the rendezvous, kept alive
        # The first failure of a command (or of a rank, seen between
        # commands); from then on none is sent.
        self.broken: Exception | None = None
        self._broken_lock = threading.Lock()
        # Called once (from whichever thread failed) when the group breaks.
        self.on_broken: list[Callable[[], None]] = []

    @contextmanager
    def command(self) -> Iterator[None]:
        """Rank 0's side of one command to the followers: holds the lock, and
        turns any failure into EngineUnusable, since a command that broke
        half way (a dead rank, an error between two collectives) leaves the
        ranks out of step for good."""
        with self.lock:
            if self.broken is not None:  # never send into a group out of step
                raise EngineUnusable(f"tensor-parallel group failed earlier: {self.broken}")
            try:
                yield
            except Exception as exc:
                self.fail(exc)
                if isinstance(exc, EngineUnusable):
                    raise
                raise EngineUnusable(f"tensor-parallel group failed: {exc}") from exc

    def fail(self, exc: Exception) -> None:
        """Mark the group broken (from any thread; the first failure wins) and
        tell the watchers, once: a rank seen gone between commands breaks it
        as a failed command does."""
        with self._broken_lock:
            if self.broken is not None:
                return
            self.broken = exc
        for watcher in self.on_broken:
            watcher()

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, columns); ValueError unless
        it divides evenly."""
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size {self.size} must divide {what} ({total})"
            )
        return total // self.size

    def host(self, host: str | None = None) -> str:
        """Rank 0: start the group's rendezvous store on ``host`` (None:
        127.0.0.1, for ranks on this machine only), at a port the system
        picks (no port to guess and race for); returns its address."""
        host = host or "127.0.0.1"
        self._store = listening_store(host, COLLECTIVE_TIMEOUT, self.size)
        return f"{host}:{self._store.port}"

    def join(self, address: str, backend: str) -> None:
        """Form the group: every rank calls this with rank 0's ``host()``."""
        if self._store is None:
            host, port = address.rsplit(":", 1)
            self._store = dist.TCPStore(host, int(port), self.size, is_master=False,
                                        timeout=COLLECTIVE_TIMEOUT)
        dist.init_process_group(backend, store=self._store, rank=self.rank,
                                world_size=self.size, timeout=COLLECTIVE_TIMEOUT)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=dist.group.WORLD)
        return x

    def gather(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``local`` (same shapes), in rank order, on rank 0."""
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        # An fp8 KV cache's blocks travel as their bytes: gloo has no fp8 type.
        dist.gather(_as_bytes(local.contiguous()),
                    [_as_bytes(p) for p in parts] if parts is not None else None, dst=0)
        return parts

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Rank 0 hands ``parts[r]`` to rank r, which receives it into ``out``."""
        dist.scatter(_as_bytes(out),
                     [_as_bytes(p.contiguous()) for p in parts] if self.rank == 0 else None, src=0)
        return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor (fp8) viewed as uint8, the same memory."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t
