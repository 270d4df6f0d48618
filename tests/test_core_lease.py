"""Cores lent between workers on one host (engine/core_lease.py): real flock
locks, the neighbour in another process."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from engine.core_lease import CoreLease


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _neighbour(lock_dir: str, busy: mp.Event, release: mp.Event, done: mp.Event) -> None:
    """Owns core 1 (and borrows none): busy until told otherwise, then idle."""
    lease = CoreLease([1], [1], lock_dir)
    lease.begin_step()
    busy.set()
    release.wait(30)
    lease.end_step(busy=False)
    done.wait(30)
    lease.close()


def _borrower_step(lock_dir: str, took: mp.Event, hold: float) -> None:
    """Owns core 1 and borrows core 0 for one step of ``hold`` seconds."""
    lease = CoreLease([1], [0, 1], lock_dir)
    lease.begin_step()
    if lease.borrowed == [0]:
        took.set()
    time.sleep(hold)
    lease.end_step(busy=False)
    lease.close()


def _busy_neighbour(lock_dir) -> tuple[mp.Process, mp.Event, mp.Event]:
    """A process owning core 1 and busy with it; set ``release`` to make it
    idle, ``done`` to end it."""
    ctx = mp.get_context("spawn")
    busy, release, done = ctx.Event(), ctx.Event(), ctx.Event()
    neighbour = ctx.Process(target=_neighbour, args=(str(lock_dir), busy, release, done))
    neighbour.start()
    assert busy.wait(60), "the neighbour did not start"
    return neighbour, release, done


def test_an_idle_neighbours_core_is_borrowed_for_a_step(tmp_path):
    neighbour, release, done = _busy_neighbour(tmp_path)
    lease = CoreLease([0], [0, 1], tmp_path)
    try:
        # The owner of core 1 has work: it is not lent.
        assert lease.begin_step() == 1 and lease.borrowed == []
        assert torch.get_num_threads() == 1
        lease.end_step(busy=True)

        release.set()  # the neighbour idles
        deadline = time.monotonic() + 30
        while True:
            threads = lease.begin_step()
            if lease.borrowed or time.monotonic() > deadline:
                break
            lease.end_step(busy=True)
            time.sleep(0.01)
        assert (threads, lease.borrowed) == (2, [1])
        assert torch.get_num_threads() == 2
        lease.end_step(busy=True)  # given back after each step
        assert lease.borrowed == []
        assert lease.steps_borrowing == 1
    finally:
        done.set()
        neighbour.join(30)
        lease.close()
    assert neighbour.exitcode == 0


def test_an_owner_with_work_waits_one_borrowed_step_then_keeps_its_core(tmp_path):
    ctx = mp.get_context("spawn")
    took = ctx.Event()
    borrower = ctx.Process(target=_borrower_step, args=(str(tmp_path), took, 1.0))
    borrower.start()
    lease = CoreLease([0], [0], tmp_path)  # owns core 0, borrows nothing
    try:
        assert took.wait(60), "the idle core was not borrowed"
        start = time.monotonic()
        lease.begin_step()  # blocks until the borrower's step ends
        waited = time.monotonic() - start
        assert 0.3 < waited < 30
        borrower.join(30)
        # A later borrower finds the core claimed while its owner has work.
        other = CoreLease([1], [0, 1], tmp_path)
        try:
            assert other.begin_step() == 1 and other.borrowed == []
            other.end_step(busy=False)
        finally:
            other.close()
        lease.end_step(busy=False)  # idle: lent again
        other = CoreLease([1], [0, 1], tmp_path)
        try:
            assert other.begin_step() == 2 and other.borrowed == [0]
        finally:
            other.close()
    finally:
        lease.close()
        borrower.join(30)


def test_a_step_told_not_to_borrow_leaves_an_idle_core_alone(tmp_path):
    lease = CoreLease([0], [0, 1], tmp_path)  # nobody owns core 1: it is idle
    try:
        assert lease.begin_step(borrow=False) == 1 and lease.borrowed == []
        assert torch.get_num_threads() == 1
        lease.end_step(busy=True)
        assert lease.begin_step() == 2 and lease.borrowed == [1]
    finally:
        lease.close()


def test_a_dead_owner_frees_its_cores(tmp_path):
    neighbour, _, _ = _busy_neighbour(tmp_path)
    lease = CoreLease([0], [0, 1], tmp_path)
    try:
        assert lease.begin_step() == 1
        lease.end_step(busy=True)
        neighbour.kill()  # holding its core, mid-work
        neighbour.join(30)
        assert lease.begin_step() == 2 and lease.borrowed == [1]
    finally:
        lease.close()


def _stepping_owner(lock_dir: str, steps, stop: mp.Event, step_s: float) -> None:
    """Owns core 1 and has work: steps of ``step_s`` until told to stop,
    counting them in ``steps``."""
    lease = CoreLease([1], [1], lock_dir)
    while not stop.is_set():
        lease.begin_step()
        time.sleep(step_s)
        with steps.get_lock():
            steps.value += 1
        lease.end_step(busy=True)
    lease.end_step(busy=False)
    lease.close()


def _stepping_neighbour(lock_dir) -> tuple[mp.Process, object, mp.Event]:
    """A process owning core 1, stepping on it (counted in ``steps``) until
    ``stop`` is set; returned once it has taken two steps."""
    ctx = mp.get_context("spawn")
    steps, stop = ctx.Value("i", 0), ctx.Event()
    owner = ctx.Process(target=_stepping_owner, args=(str(lock_dir), steps, stop, 0.05))
    owner.start()
    deadline = time.monotonic() + 60
    while steps.value < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert steps.value >= 2, "the owner did not start stepping"
    return owner, steps, stop


def test_a_busy_owner_lends_a_neighbour_with_a_backlog_every_other_step(tmp_path):
    owner, steps, stop = _stepping_neighbour(tmp_path)
    lease = CoreLease([0], [0, 1], tmp_path, wait_s=10)
    try:
        seen = []
        for _ in range(3):
            # The owner is busy, but lends its core for this step...
            assert lease.begin_step(backlog=lambda share: True) == 2 and lease.borrowed == [1]
            before = steps.value
            time.sleep(0.3)
            # ... and does not step on it meanwhile.
            assert steps.value == before
            lease.end_step(busy=True)
            seen.append(before)
        # Between two lent steps the owner took one of its own: turns.
        assert seen[1] > seen[0] and seen[2] > seen[1], seen
        assert lease.steps_borrowing == 3
    finally:
        stop.set()
        owner.join(30)
        lease.close()
    assert owner.exitcode == 0


def test_a_borrower_without_a_backlog_does_not_wait_for_a_busy_owner(tmp_path):
    owner, _, stop = _stepping_neighbour(tmp_path)
    waits = CoreLease([0], [0, 1], tmp_path, wait_s=10)
    never = CoreLease([2], [1, 2], tmp_path)  # wait_s 0: never waits
    asked = []
    try:
        for _ in range(3):
            start = time.monotonic()
            assert waits.begin_step(backlog=lambda share: asked.append(share) or False) == 1
            assert waits.borrowed == []
            assert never.begin_step(backlog=lambda share: True) == 1 and never.borrowed == []
            assert time.monotonic() - start < 5  # neither waited its 10 s
            waits.end_step(busy=True)
            never.end_step(busy=True)
        # Asked with its share of the cores: one of two, so half a step's budget.
        assert asked == [0.5, 0.5, 0.5]
    finally:
        stop.set()
        owner.join(30)
        waits.close()
        never.close()


def test_a_borrower_with_a_backlog_waits_no_longer_than_its_bound(tmp_path):
    # The owner holds its core in one long step: it never gets to lend.
    neighbour, release, done = _busy_neighbour(tmp_path)
    lease = CoreLease([0], [0, 1], tmp_path, wait_s=0.3)
    try:
        start = time.monotonic()
        assert lease.begin_step(backlog=lambda share: True) == 1 and lease.borrowed == []
        waited = time.monotonic() - start
        assert 0.3 <= waited < 10
        lease.end_step(busy=True)
        # It stopped waiting: the owner, stepping again, sees nobody waiting
        # and keeps its core.
        owner_view = CoreLease([1], [1], tmp_path)
        try:
            assert not owner_view._neighbour_waits()
        finally:
            owner_view.close()
    finally:
        release.set()
        done.set()
        neighbour.join(30)
        lease.close()


def test_a_backlog_is_the_share_of_a_step_that_own_cores_compute_alone(tmp_path):
    for own, borrow, share in (([0], [0, 1], 1 / 2), ([0], [0, 1, 2], 1 / 3),
                               ([0, 1], [0, 1, 2, 3], 1 / 2), ([0, 1], [0, 1], 1.0)):
        lease = CoreLease(own, borrow, tmp_path)
        try:
            assert lease.own_share == pytest.approx(share)
        finally:
            lease.close()


def test_a_lease_needs_a_core_of_its_own(tmp_path):
    with pytest.raises(ValueError, match="at least one core"):
        CoreLease([], [0, 1], tmp_path)
    with pytest.raises(ValueError, match="wait_s"):
        CoreLease([0], [0, 1], tmp_path, wait_s=-1)
