"""Cores that workers on one host lend each other while they idle.

Workers on one host each own some cores (``--cpu-cores``): two full OpenMP
teams on the same cores stall each other at every barrier. But a split that
is right under load wastes half the host in a burst: a prefill worker idles
while its decode worker runs, and the other way round. So a worker may
borrow an idle neighbour's cores for one step at a time, and gives them
back at the end of each step; the owner, once it has work again, waits at
most for that one step.

The host's cores are coordinated with ``flock`` on two files per core in a
shared directory (locks die with their process, so a crashed worker frees
its cores):

    <dir>/<core>.run    held by whoever computes on the core: its owner,
                        from its first step until it goes idle, or a
                        borrower for the length of one step
    <dir>/<core>.claim  held by the owner while it has work, so a borrower
                        sees that the owner wants the core back (without
                        it, a borrower that re-takes ``.run`` right after
                        each step could starve a waiting owner)

A borrower takes a core only when it can take and drop ``.claim`` (the owner
is idle) and then take ``.run`` (nobody computes on it). The torch thread
count follows the cores held, one thread each.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from pathlib import Path

import torch


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class CoreLease:
    """One worker's side of a host's shared cores: call ``begin_step``
    before each step, ``end_step`` after it, and ``idle`` when the worker
    has no work. Used from one thread at a time (the engine loop's)."""

    def __init__(self, own: Iterable[int], borrow: Iterable[int], lock_dir: str | Path) -> None:
        self.own = sorted(set(own))
        if not self.own:
            raise ValueError("a core lease needs at least one core of its own")
        self.others = sorted(set(borrow) - set(self.own))
        directory = Path(lock_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self._run: dict[int, int] = {}
        self._claim: dict[int, int] = {}
        for core in self.own + self.others:
            self._run[core] = os.open(directory / f"{core}.run", os.O_RDWR | os.O_CREAT, 0o600)
            self._claim[core] = os.open(directory / f"{core}.claim",
                                        os.O_RDWR | os.O_CREAT, 0o600)
        self._holding_own = False
        self.borrowed: list[int] = []
        self._threads = 0
        self.steps_borrowing = 0  # steps that ran on at least one borrowed core

    def begin_step(self) -> int:
        """Hold this worker's own cores (waiting for a borrower's step to
        end), borrow whichever idle neighbours' cores are free, and size
        torch's thread team to match. Returns the thread count."""
        if not self._holding_own:
            for core in self.own:
                fcntl.flock(self._claim[core], fcntl.LOCK_EX)
                fcntl.flock(self._run[core], fcntl.LOCK_EX)  # a borrower's step at most
            self._holding_own = True
        for core in self.others:
            if not _try_lock(self._claim[core]):
                continue  # its owner has work
            fcntl.flock(self._claim[core], fcntl.LOCK_UN)
            if _try_lock(self._run[core]):
                self.borrowed.append(core)
        self.steps_borrowing += bool(self.borrowed)
        self._set_threads(len(self.own) + len(self.borrowed))
        return self._threads

    def end_step(self, busy: bool) -> None:
        """Give borrowed cores back; the own ones too when there is no more
        work (``busy`` False)."""
        for core in self.borrowed:
            fcntl.flock(self._run[core], fcntl.LOCK_UN)
        self.borrowed.clear()
        if not busy:
            self.idle()

    def idle(self) -> None:
        """No work: neighbours may borrow this worker's cores."""
        if self._holding_own:
            for core in self.own:
                fcntl.flock(self._run[core], fcntl.LOCK_UN)
                fcntl.flock(self._claim[core], fcntl.LOCK_UN)
            self._holding_own = False

    def close(self) -> None:
        self.end_step(busy=False)
        for fd in [*self._run.values(), *self._claim.values()]:
            os.close(fd)
        self._run.clear()
        self._claim.clear()

    def _set_threads(self, n: int) -> None:
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n
