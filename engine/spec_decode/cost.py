"""What steps cost, measured online from the engine's own steps.

Every decode-only step (no prefill chunk in it) is one observation: the
time from the start of scheduling to the end of ``Scheduler.update``, less
the proposer's own time, at the step's number of rows ``R`` (one per
decoding sequence, plus one per proposed token), kept apart for plain steps
and for steps that verify a proposal. Each table holds, per ``R``, a
running mean of the recent steps of that size. The drafter asks what a
plain step of its ``B`` sequences costs and what a verifying step of ``B +
E`` rows would, for every ``E`` it might choose (engine/spec_decode/
drafter.py).

NOTE: a table, not a formula, because the cost of a step is not linear in
its rows. On the 2-core CPU this was written on (SmolLM2-135M, float32, one
thread) a forward over 16 rows took 125 ms, over 12 rows 160 ms and over 4
rows 105 ms (the matmul kernels pick their blocking by the row count), and
rows past 16 cost about 2.5 ms each; on a GPU a step stays flat in its rows
up to large batches. A verifying step also pays something once (its rows
take the attention backends' prefill path, the verifier runs): about 5-10
ms at 16 rows there.

Between the sizes seen, costs are interpolated linearly; below the smallest
they are taken as flat, above the largest they grow with the average slope
over the sizes seen (flat with one size): optimistic, so sizes not seen yet
get tried, and a tried size is then known. Where one kind of step has not
been seen at a size, the other kind's cost there counts, corrected by the
measured difference between the two at sizes seen with both. Each entry
is the mean of its first four observations, then moves a quarter of the way
to each new one; a step that took more than twice its size's entry counts
as twice the entry (a step interrupted by something else says little about
its size).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

WEIGHT = 0.25  # of a new observation in its size's entry
MIN_STEPS = 3  # plain steps before the tables are used
OUTLIER = 2.0


@dataclass(frozen=True)
class StepCosts:
    """Seconds, at ``B`` decoding sequences: ``plain``, a step without
    speculation; ``verify[E]``, a step verifying ``E`` proposed tokens in
    all (``verify[0]`` unused); ``propose``, the proposer's time per guess
    asked for."""

    plain: float
    verify: np.ndarray
    propose: float = 0.0


class StepCostModel:
    """The tables above. ``start`` at the start of a step, ``proposed`` after
    the proposer ran, ``end`` once the step's results are in;
    ``estimate(B, max_draft)`` for a decision."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        """Forget every step seen: calibrate afresh from the next ones."""
        self._plain: dict[int, float] = {}
        self._verify: dict[int, float] = {}
        self._counts: dict[tuple[bool, int], int] = {}  # observations per (verifying, rows)
        self._num_plain = 0
        self._gap = 0.0  # verify - plain at sizes seen with both (running mean)
        self._gap_seen = False
        self._propose_seconds = self._propose_guesses = 0.0  # decayed sums
        self._t0 = self._propose_s = 0.0

    def start(self) -> None:
        self._t0, self._propose_s = self.clock(), 0.0

    def proposed(self, num_asked: int) -> None:
        """The proposer just ran, for ``num_asked`` guesses in all."""
        self._propose_s = self.clock() - self._t0
        if num_asked:
            self._propose_seconds = (1 - WEIGHT) * self._propose_seconds + self._propose_s
            self._propose_guesses = (1 - WEIGHT) * self._propose_guesses + num_asked

    def end(self, num_seqs: int, num_draft: int) -> None:
        """The step that ``start`` began is done: ``num_seqs`` sequences
        decoded, ``num_draft`` proposed tokens verified among them."""
        self.observe(num_seqs, num_draft, self.clock() - self._t0 - self._propose_s)

    def observe(self, num_seqs: int, num_draft: int, seconds: float) -> None:
        rows = num_seqs + num_draft
        table, other = (self._verify, self._plain) if num_draft else (self._plain, self._verify)
        old = table.get(rows)
        count = self._counts[bool(num_draft), rows] = self._counts.get((bool(num_draft), rows), 0) + 1
        # The mean of the first few, then a running mean.
        table[rows] = seconds if old is None else \
            old + max(WEIGHT, 1 / count) * (min(seconds, OUTLIER * old) - old)
        if not num_draft:
            self._num_plain += 1
        if rows in other:  # both kinds seen at this size: how far apart they are
            gap = (table[rows] - other[rows]) * (1 if num_draft else -1)
            self._gap = gap if not self._gap_seen else self._gap + WEIGHT * (gap - self._gap)
            self._gap_seen = True

    @property
    def calibrated(self) -> bool:
        return self._num_plain >= MIN_STEPS

    def snapshot(self) -> dict[str, dict[int, float]]:
        """The tables, seconds by rows (benchmarks print what was measured)."""
        return {"plain": dict(sorted(self._plain.items())),
                "verify": dict(sorted(self._verify.items()))}

    def estimate(self, num_seqs: int, max_draft: int) -> StepCosts | None:
        """Costs at ``num_seqs`` sequences and up to ``max_draft`` proposed
        tokens, or None before ``MIN_STEPS`` plain steps were seen."""
        if not self.calibrated or num_seqs < 1:
            return None
        gap = max(self._gap, 0.0)
        plain = _curve(self._plain, self._verify, -gap, np.array([num_seqs]))[0]
        verify = _curve(self._verify, self._plain, gap, num_seqs + np.arange(max_draft + 1))
        propose = self._propose_seconds / self._propose_guesses if self._propose_guesses else 0.0
        if plain <= 0 or verify.min() <= 0:  # a clock too coarse to tell
            return None
        return StepCosts(plain=float(plain), verify=verify, propose=propose)


def _curve(own: dict[int, float], other: dict[int, float], shift: float,
           rows: np.ndarray) -> np.ndarray:
    """Costs at ``rows`` from the sizes ``own`` has seen, and ``other``'s
    plus ``shift`` where ``own`` has not (module docstring)."""
    points = {r: t + shift for r, t in other.items()}
    points.update(own)
    xs = np.array(sorted(points), dtype=np.float64)
    ys = np.array([points[r] for r in sorted(points)])
    out = np.interp(rows, xs, ys)
    if len(xs) > 1:
        slope = max((ys[-1] - ys[0]) / (xs[-1] - xs[0]), 0.0)
        above = rows > xs[-1]
        out[above] = ys[-1] + slope * (rows[above] - xs[-1])
    return out


class FixedCosts:
    """``StepCostModel``'s interface with costs given rather than measured:
    a step costs ``token`` per sequence, plus ``step`` and ``row`` per
    proposed token when it verifies. Decisions that do not depend on timing
    (tests; ``FixedCosts(1, 0, 0)``: every guess pays)."""

    calibrated = True

    def __init__(self, token: float, step: float, row: float) -> None:
        self.token, self.step, self.row = token, step, row

    def reset(self) -> None:
        pass

    def start(self) -> None:
        pass

    def proposed(self, num_asked: int) -> None:
        pass

    def end(self, num_seqs: int, num_draft: int) -> None:
        pass

    def estimate(self, num_seqs: int, max_draft: int) -> StepCosts:
        plain = self.token * num_seqs
        return StepCosts(plain, plain + self.step + self.row * np.arange(max_draft + 1.0))


def default_clock(device: str) -> Callable[[], float]:
    """The engine thread's CPU time on the CPU: a step's own cost, whatever
    else the machine runs (with more torch threads, that thread's share,
    alike for both kinds of step). Wall time on an accelerator, where the
    thread mostly waits for the device."""
    return time.thread_time if device.startswith("cpu") else time.perf_counter
