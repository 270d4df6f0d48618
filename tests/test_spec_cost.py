"""When speculation pays (engine/spec_decode/cost.py, drafter.py): the
step-cost tables, and the drafter's decisions against given costs and
against step times from a clock the test drives (no real timing)."""

from __future__ import annotations

import pytest

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.spec_config import SpeculativeConfig
from engine.spec_decode.base import Proposal, Proposer
from engine.spec_decode.cost import MIN_STEPS, FixedCosts, StepCostModel
from engine.spec_decode.drafter import MAX_BACKOFF, SpecDecoder

K = 4


class Echo(Proposer):
    """Proposes as many tokens as asked (or ``limit``)."""

    name = "echo"

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        return [Proposal([7] * min(r.max_tokens, self.limit or r.max_tokens)) for r in requests]


def decoding(num: int) -> list[Request]:
    """Sequences with one token left to compute, room for K guesses."""
    out = []
    for i in range(num):
        r = Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=10_000))
        r.token_ids.append(5)
        r.num_computed_tokens = r.num_tokens - 1
        out.append(r)
    return out


def decoder(cost, proposer: Proposer | None = None) -> SpecDecoder:
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=K), proposer or Echo(), 100_000)
    spec.cost = cost
    return spec


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(spec: SpecDecoder, requests: list[Request], steps: int, accept,
        clock: Clock | None = None, step_seconds=None) -> list[dict[str, int]]:
    """``steps`` steps: propose, verify (``accept(step, request_id, guesses)``
    of them held), and, with a clock, time each step by ``step_seconds(rows,
    verifying)``. Returns each step's guesses per sequence."""
    history = []
    for step in range(steps):
        proposals = spec.propose(requests)
        guesses = {rid: len(p.token_ids) for rid, p in proposals.items()}
        for rid, n in guesses.items():
            spec.observe(rid, n, accept(step, rid, n))
        if clock is not None:
            rows = len(requests) + sum(guesses.values())
            clock.now += step_seconds(rows, bool(guesses))
            spec.end_step(SchedulerOutput(scheduled=[
                ScheduledRequest(r.request_id, r.num_tokens - 1, 1 + guesses.get(r.request_id, 0),
                                 [], True, [7] * guesses.get(r.request_id, 0))
                for r in requests]))
        history.append(guesses)
    return history


# ---- the tables ------------------------------------------------------------------------


def test_step_costs_are_interpolated_between_the_sizes_seen():
    model = StepCostModel()
    assert model.estimate(4, 8) is None
    for _ in range(MIN_STEPS):
        model.observe(4, 0, 0.100)
    model.observe(16, 0, 0.120)
    model.observe(16, 4, 0.140)
    model.observe(16, 16, 0.160)
    model.observe(12, 4, 0.130)  # 16 rows, seen plain too: verifying costs 0.01 more there
    costs = model.estimate(10, 30)
    assert costs.plain == pytest.approx(0.110)  # between 4 and 16 rows
    assert costs.verify[6] == pytest.approx(0.130)  # 16 rows
    assert costs.verify[16] == pytest.approx(0.150)  # 26, between 20 and 32
    # Plain sizes count for verifying with the gap: 4 rows, 0.11.
    slope = (0.160 - 0.110) / (32 - 4)  # the average over the sizes seen
    assert costs.verify[30] == pytest.approx(0.160 + 8 * slope)  # 40 rows, above them
    assert costs.verify[0] == pytest.approx(0.110 + 6 * (0.130 - 0.110) / 12)
    # And verifying sizes count for plain steps, less the gap.
    assert model.estimate(32, 0).plain == pytest.approx(0.150)
    assert model.estimate(1, 0).plain == pytest.approx(0.100)  # below the sizes seen: flat


def test_an_interrupted_step_moves_its_entry_a_bounded_amount():
    model = StepCostModel()
    for _ in range(MIN_STEPS):
        model.observe(8, 0, 0.1)
    model.observe(8, 0, 10.0)
    assert model.estimate(8, 0).plain == pytest.approx(0.1 + 0.25 * 0.1)


def test_the_proposers_time_is_measured_apart():
    clock = Clock()
    model = StepCostModel(clock)
    for _ in range(MIN_STEPS):
        model.start()
        clock.now += 0.5
        model.proposed(10)
        clock.now += 0.1
        model.end(4, 0)
    costs = model.estimate(4, 0)
    assert costs.plain == pytest.approx(0.1) and costs.propose == pytest.approx(0.05)


# ---- decisions against given costs -----------------------------------------------------


def test_free_rows_take_every_guess():
    spec = decoder(FixedCosts(token=1.0, step=0.0, row=0.0))
    history = run(spec, decoding(3), 20, lambda step, rid, n: n)
    assert all(g == {"r0": K, "r1": K, "r2": K} for g in history)


def test_a_sequence_whose_guesses_fail_pauses_and_probes_less_and_less_often():
    spec = decoder(FixedCosts(token=1.0, step=0.0, row=0.5))
    history = run(spec, decoding(1), 300, lambda step, rid, n: 0)
    steps = [i + 1 for i, g in enumerate(history) if g]  # the drafter counts steps from 1
    assert history[0] == {"r0": 1}  # the prior rate (0.7) pays one guess only
    assert all(g == {"r0": 1} for g in history if g)
    # Pauses of 4, 8, 16, 32 and 64 steps, each probe on a multiple of its pause.
    assert steps == [1, 8, 24, 48, 96, 192] and MAX_BACKOFF == 64


class CountingCosts(FixedCosts):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.estimates = 0

    def estimate(self, num_seqs, max_draft):
        self.estimates += 1
        return super().estimate(num_seqs, max_draft)


def test_steps_with_every_sequence_paused_do_not_weigh_costs():
    costs = CountingCosts(1.0, 0.0, 0.5)
    spec = decoder(costs)
    history = run(spec, decoding(2), 300, lambda step, rid, n: 0)
    # Only a probe's step and the step after it (which pauses again) weigh costs.
    probes = sum(map(bool, history))
    assert probes == 6 and costs.estimates == 2 * probes


def test_a_new_sequence_starts_from_the_pause_the_last_one_reached():
    spec = decoder(FixedCosts(token=1.0, step=0.0, row=0.5))
    run(spec, decoding(1), 300, lambda step, rid, n: 0)
    spec.forget("r0")
    history = run(spec, decoding(1), 200, lambda step, rid, n: 0)
    probes = [i for i, g in enumerate(history) if g]
    assert 1 <= len(probes) <= 2 and probes[0] > MAX_BACKOFF


def test_a_probe_that_holds_brings_speculation_back():
    spec = decoder(FixedCosts(token=1.0, step=0.0, row=0.3))
    history = run(spec, decoding(1), 300, lambda step, rid, n: 0 if step < 100 else n)
    assert sum(map(bool, history[:100])) < 10
    assert all(g == {"r0": K} for g in history[-50:])


def test_a_dear_step_speculates_only_when_probes_pay_for_it():
    """Verifying costs 100 tokens once per step: not worth it for 4
    sequences, but the probes, which go ahead, take every guess along."""
    spec = decoder(FixedCosts(token=1.0, step=100.0, row=0.0))
    history = run(spec, decoding(4), 100, lambda step, rid, n: n)
    active = [i for i, g in enumerate(history) if g]
    assert 0 < len(active) < 20
    assert all(history[i] == {f"r{j}": K for j in range(4)} for i in active)


def test_a_lookup_that_finds_less_is_checked_again():
    """Four guesses pay at the prior rate; the one found does not."""
    proposer = Echo(limit=1)
    spec = decoder(FixedCosts(token=1.0, step=0.8, row=0.0), proposer)
    assert spec.propose(decoding(1)) == {} and proposer.calls == 1


# ---- decisions against measured step times ----------------------------------------------


@pytest.mark.parametrize("shape", ["flat", "linear"])
def test_the_drafter_learns_what_rows_cost_from_step_times(shape):
    """About half the guesses hold. Where a step's time is flat in its rows
    (a memory-bound decode) the drafter guesses freely; where each row costs
    as much as a token, it stops, but for rare probes."""
    clock = Clock()
    spec = decoder(StepCostModel(clock))

    def seconds(rows, verifying):
        return 0.1 + 0.001 * rows if shape == "flat" else 0.03 * rows

    def accept(step, rid, n):
        return int((7 * step + 3 * int(rid[1:])) % 5 < 2)  # the first, 2 times in 5

    history = run(spec, decoding(4), 400, accept, clock, seconds)
    late = history[100:]
    if shape == "flat":  # every sequence, 2-3 guesses (a 4th is worth less than its row)
        assert all(len(g) == 4 for g in late)
        assert 2 <= sum(sum(g.values()) for g in late) / (4 * len(late)) <= 3
    else:
        assert sum(map(bool, late)) < 0.1 * len(late)
