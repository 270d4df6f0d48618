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

    <dir>/<core>.want   held by a borrower with a backlog while it waits, at the
                        start of its step, for a busy owner to lend the core

A borrower takes a core only when it can take and drop ``.claim`` (the owner
is idle) and then take ``.run`` (nobody computes on it). The torch thread
count follows the cores held, one thread each.

Some work cannot wait for a neighbour to idle: a prefill worker's backlog is
every queued request's time to first token, while its decode neighbour's
running requests lose only one token's time to a step lent out.

A backlog here is more queued than the worker's own cores compute in the
time that all the cores it may use take for a whole step: with one core of
two, half a step's budget (``own_share``). Above it, the queue computed alone
waits longer than a full lent step would take (the tail of a burst, just
short of a whole budget, took 2.1-3.5 s on one core against 1.2-1.5 s lent).
Below it, as with a few
short prompts queued, the neighbour keeps its cores: lent for every step,
they doubled its time per output token (docs/benchmarks.md, eighteenth
session).

A lease with a ``wait_s`` (a prefill worker's) that starts a step with a
backlog and finds a core's owner busy takes ``.want`` and waits up to
``wait_s`` for it; an owner that sees ``.want`` held at the start of a step
lends its cores for the borrower's next step and takes them back after it.
Under a backlog the two take turns, a step each, so a decode worker's
requests still get a token every other step; the borrower waits for the
owner's step to end (the short one), never the owner for the borrower's
idle time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


_POLL_S = 0.001  # how often a waiting borrower or a lending owner looks again


class CoreLease:
    """One worker's side of a host's shared cores: call ``begin_step``
    before each step, ``end_step`` after it, and ``idle`` when the worker
    has no work. Used from one thread at a time (the engine loop's).

    ``wait_s``: how long a step begun with a backlog waits for busy
    neighbours to lend their cores (module docstring); 0: never."""

    def __init__(self, own: Iterable[int], borrow: Iterable[int], lock_dir: str | Path,
                 wait_s: float = 0.0) -> None:
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        self.own = sorted(set(own))
        if not self.own:
            raise ValueError("a core lease needs at least one core of its own")
        self.others = sorted(set(borrow) - set(self.own))
        directory = Path(lock_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.wait_s = wait_s
        self._run: dict[int, int] = {}
        self._claim: dict[int, int] = {}
        self._want: dict[int, int] = {}
        for core in self.own + self.others:
            for kind, fds in (("run", self._run), ("claim", self._claim), ("want", self._want)):
                fds[core] = os.open(directory / f"{core}.{kind}", os.O_RDWR | os.O_CREAT, 0o600)
        self._holding_own = False
        self.borrowed: list[int] = []
        self._threads = 0
        self.steps_borrowing = 0  # steps that ran on at least one borrowed core
        self.steps_lent = 0  # a waiting neighbour's steps this worker's cores were lent to

    @property
    def own_share(self) -> float:
        """This worker's share of the cores it computes on when it borrows
        all it may: the share of a step's budget that makes a backlog."""
        return len(self.own) / (len(self.own) + len(self.others))

    def begin_step(self, backlog: Callable[[float], bool] | None = None,
                   borrow: bool = True) -> int:
        """Hold this worker's own cores (waiting for a borrower's step to
        end), borrow whichever idle neighbours' cores are free (unless
        ``borrow`` is False; if ``backlog(own_share)`` says so, wait up to
        ``wait_s`` for busy ones to lend theirs; asked only then, not every
        step), and size torch's thread team to match. Returns the thread
        count."""
        if self._holding_own and self._neighbour_waits():
            self._lend_one_step()  # then this step: a step of each, by turns
        if not self._holding_own:
            for core in self.own:
                fcntl.flock(self._claim[core], fcntl.LOCK_EX)
                fcntl.flock(self._run[core], fcntl.LOCK_EX)  # a borrower's step at most
            self._holding_own = True
        missing = [core for core in self.others if not (borrow and self._borrow(core))]
        if missing and self.wait_s > 0 and backlog is not None and backlog(self.own_share):
            self._wait_for(missing)
        self.steps_borrowing += bool(self.borrowed)
        self._set_threads(len(self.own) + len(self.borrowed))
        return self._threads

    @contextlib.contextmanager
    def step(self, backlog: Callable[[float], bool] | None = None,
             busy: Callable[[], bool] | None = None, borrow: bool = True) -> Iterator[None]:
        """``begin_step`` and ``end_step`` around a block; ``busy()`` (None:
        not busy) is asked once it has run, however it ends."""
        self.begin_step(backlog, borrow)
        try:
            yield
        finally:
            self.end_step(busy=busy is not None and busy())

    def _borrow(self, core: int) -> bool:
        """Take ``core`` for one step if its owner idles and nobody computes on it."""
        if not _try_lock(self._claim[core]):
            return False  # its owner has work
        fcntl.flock(self._claim[core], fcntl.LOCK_UN)
        if not _try_lock(self._run[core]):
            return False
        self.borrowed.append(core)
        return True

    def _wait_for(self, cores: list[int]) -> None:
        """Tell the busy owners of ``cores`` that this worker waits
        (``.want``), and take each one they lend within ``wait_s``."""
        wanted = [core for core in cores if _try_lock(self._want[core])]
        try:
            deadline = time.monotonic() + self.wait_s
            while wanted and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                for core in list(wanted):
                    if self._borrow(core):
                        fcntl.flock(self._want[core], fcntl.LOCK_UN)
                        wanted.remove(core)
        finally:
            for core in wanted:
                fcntl.flock(self._want[core], fcntl.LOCK_UN)

    def _neighbour_waits(self) -> bool:
        """Whether a neighbour with a backlog waits for one of this worker's cores."""
        for core in self.own:
            if not _try_lock(self._want[core]):
                return True
            fcntl.flock(self._want[core], fcntl.LOCK_UN)
        return False

    def _lend_one_step(self) -> None:
        """Let the waiting neighbour have this worker's cores: drop them,
        wait until it has taken them (or stopped waiting), then queue for
        them again, behind its step."""
        self.idle()
        for core in self.own:
            while not _try_lock(self._want[core]):
                time.sleep(_POLL_S)
            fcntl.flock(self._want[core], fcntl.LOCK_UN)
        self.steps_lent += 1

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
        for fd in [*self._run.values(), *self._claim.values(), *self._want.values()]:
            os.close(fd)
        for fds in (self._run, self._claim, self._want):
            fds.clear()

    def _set_threads(self, n: int) -> None:
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n
