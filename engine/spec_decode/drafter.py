"""The scheduler's side of speculation: which sequences speculate this step,
how many tokens each may guess, and turning speculation off where it does
not pay.

A sequence speculates when it is decoding (one token left to compute), its
sampling needs nothing the verifier does not do (no logprobs, no
penalties, ``min_tokens`` reached), and it has room: a guess past
``max_tokens`` or the model's length would be thrown away, so the cap also
keeps a sequence within the blocks ``LLMEngine.validate`` promised it.

How many guesses. A sequence's acceptance rate ``a`` is the chance that a
guess is right when the ones before it were: accepted guesses over accepted
guesses plus rejections (each verification ends at most once), decayed by
half per proposal, starting from the rate over all sequences. Its ``i``-th
guess is then expected to yield ``a^i`` tokens. ``cost.py`` measures, from
this engine's own steps, what a plain step of the ``B`` decoding sequences
costs and what a step verifying ``E`` guesses would. The step takes the
``E`` guesses worth most (a sequence's first before its second), with the
``E`` that gives the most expected tokens per second, ``(B + sum of their
a^i) / cost(B + E)``, and speculates only if that beats a plain step's
``B / cost(B)`` by 3% (``MARGIN``; checked again with what was proposed: a
lookup may find less). So when acceptance collapses, or rows are dear, speculation stops;
when rows are nearly free (a CPU's matmul below its blocking size, a GPU's
memory-bound decode), it guesses freely.

Pauses and probes: a sequence none of whose guesses is taken pauses, then
probes with at least one guess, which can bring its rate back when the
text starts to repeat. The pause is 4 steps, doubling to 64 while its
probes find nothing, and back to 4 once the sequence's guesses are taken
again; a new sequence starts from the pause the last sequence to finish
had reached, so text that never pays is not probed afresh per request.
Probes fall on steps that are multiples of the pause (one to two pauses
away), so the sequences that pause alike probe in the same step and share
what verifying costs once; a step with a probe takes every guess that adds
to its tokens per second. Until the cost model has seen a few
plain steps, every other step speculates with every guess, the others run
plain.

Seeded sequences decide like the others, by timing and batch: that cannot
change their text, because the verifier uses a seeded sequence's random
numbers exactly as plain sampling does, one noise vector per emitted token
in order (verify.py). A rule that let the number of guesses decide which
random numbers a seeded sequence uses would make its text depend on the
machine's load; keep it so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from engine.request import Request
from engine.scheduler_output import SchedulerOutput
from engine.spec_config import SpeculativeConfig
from engine.spec_decode.base import DraftRequest, Proposal, Proposer
from engine.spec_decode.cost import StepCostModel, StepCosts, default_clock
from engine.spec_decode.stats import SpecDecodeStats

DECAY = 0.5  # weight a sequence's acceptance counts keep per proposal
GLOBAL_DECAY = 0.99  # the same over all sequences' proposals
BACKOFF_STEPS = 4
MAX_BACKOFF = 64
# NOTE: speculate only when expected tokens per second beat a plain step's by
# this much: the step-cost tables are running means of noisy timings (a few
# percent apart at one size), and a guess that only breaks even is a loss
# whenever they err.
MARGIN = 1.03


@dataclass
class _SeqState:
    accepted: float = 0.0  # decayed: guesses accepted
    trials: float = 0.0  # decayed: guesses accepted, plus rejections
    backoff: int = BACKOFF_STEPS
    probe_at: int | None = None  # paused: probes at this step
    probing: bool = False  # this step's guesses are a probe


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int,
                 device: str = "cpu"):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        # StepCostModel, or anything with its interface (cost.FixedCosts in tests).
        self.cost = StepCostModel(default_clock(device))
        self.stats = SpecDecodeStats()
        self._seqs: dict[str, _SeqState] = {}
        # Over all sequences, decayed; a new sequence starts from this rate,
        # and from the pause the last sequence to finish had reached.
        self._accepted, self._trials = 0.7, 1.0
        self._backoff = BACKOFF_STEPS
        self._step = 0

    def propose(self, running: list[Request]) -> dict[str, Proposal]:
        """Proposals for the running sequences that speculate this step."""
        self._step += 1
        self.cost.start()
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        k = self.config.num_speculative_tokens
        candidates = []
        for r in decoding:
            room = min(k, r.params.max_tokens - r.num_output_tokens - 1,
                       self.max_model_len - r.num_tokens)
            if room >= 1 and speculates(r):
                state = self._seqs.get(r.request_id)
                if state is None:
                    state = self._seqs[r.request_id] = _SeqState(backoff=self._backoff)
                state.probing = False
                candidates.append((r, state, room))
        if not candidates or self._all_paused(candidates):
            return {}
        costs = self.cost.estimate(len(decoding), sum(room for _, _, room in candidates))
        if costs is None:  # calibrating: every other step plain, the others every guess
            plans = [] if self._step % 2 else candidates
        else:
            plans = self._plan(candidates, len(decoding), costs)
        if not plans:
            return {}
        asks = [DraftRequest(r.request_id, r.token_ids, n) for r, _, n in plans]
        proposals = self.proposer.propose(asks)
        self.cost.proposed(sum(a.max_tokens for a in asks))
        kept = [(a.request_id, state, p) for a, (_, state, _), p in
                zip(asks, plans, proposals, strict=True) if p.token_ids]
        if costs is not None and not any(state.probing for _, state, _ in kept):
            guesses = sum(len(p.token_ids) for _, _, p in kept)
            tokens = len(decoding) + sum(self._expected(state, len(p.token_ids))
                                         for _, state, p in kept)
            if tokens / costs.verify[guesses] <= MARGIN * len(decoding) / costs.plain:
                self._pause(state for _, state, _ in kept)  # not those a lookup found nothing for
                return {}
        return {rid: p for rid, _, p in kept}

    def _plan(self, candidates: list[tuple[Request, _SeqState, int]], num_seqs: int,
              costs: StepCosts) -> list[tuple[Request, _SeqState, int]]:
        """(request, state, guesses) for the sequences that speculate: the
        guesses that give the most tokens per second (module docstring);
        probes' first guesses always."""
        forced, optional = [], []
        for i, (_, state, room) in enumerate(candidates):
            if state.probe_at is not None:
                if self._step < state.probe_at:
                    continue
                state.probe_at, state.probing = None, True
            rate = self.rate(state)
            values = [(rate ** n, i) for n in range(1, room + 1)]
            if state.probing:
                forced.append(values.pop(0))
            optional += values
        optional.sort(key=lambda v: -v[0])  # stable: a sequence's guesses stay in order
        chosen = forced + optional
        tokens = num_seqs + np.cumsum([0.0] + [v for v, _ in chosen])
        guesses = np.arange(len(chosen) + 1)
        per_second = tokens / (costs.verify[: len(chosen) + 1] + costs.propose * guesses)
        per_second[: len(forced) + (not forced)] = 0.0  # at least the probes; without, a guess
        best = int(per_second.argmax())
        if not forced and per_second[best] <= MARGIN * num_seqs / costs.plain:
            best = 0
        lengths = [0] * len(candidates)
        for _, i in chosen[:best]:
            lengths[i] += 1
        plans = []
        for (r, state, _), n in zip(candidates, lengths, strict=True):
            if n:
                plans.append((r, state, n))
                if not state.probing:  # it pays again: pauses start short
                    state.backoff = BACKOFF_STEPS
            elif state.probe_at is None:
                self._pause([state])
        return plans

    def _all_paused(self, candidates: list[tuple[Request, _SeqState, int]]) -> bool:
        """Every candidate paused, none probing this step: nothing to weigh.
        NOTE: the common step where lookups do not pay; it skips the cost
        tables' interpolation (a few hundred microseconds a step in Python)."""
        return self.cost.calibrated and all(
            state.probe_at is not None and self._step < state.probe_at
            for _, state, _ in candidates)

    def _expected(self, state: _SeqState, guesses: int) -> float:
        rate = self.rate(state)
        return sum(rate ** n for n in range(1, guesses + 1))

    def _pause(self, states: Iterable[_SeqState]) -> None:
        """No guesses for a while; then a probe, on a step that is a multiple
        of the pause and at least one pause away."""
        for state in states:
            if state.probe_at is None:
                state.probe_at = (self._step // state.backoff + 2) * state.backoff

    def rate(self, state: _SeqState) -> float:
        """The sequence's acceptance rate, with the rate over all sequences
        counting as one guess of its own."""
        prior = self._accepted / self._trials
        return (state.accepted + prior) / (state.trials + 1)

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """A proposal of ``num_draft`` tokens was verified; ``num_accepted`` held."""
        self.stats.observe(num_draft, num_accepted)
        state = self._seqs.setdefault(request_id, _SeqState())
        trials = num_accepted + (num_accepted < num_draft)
        state.accepted = DECAY * state.accepted + num_accepted
        state.trials = DECAY * state.trials + trials
        self._accepted = GLOBAL_DECAY * self._accepted + num_accepted
        self._trials = GLOBAL_DECAY * self._trials + trials
        if state.probing and not num_accepted:
            state.backoff = min(2 * state.backoff, MAX_BACKOFF)
        state.probing = False

    def end_step(self, out: SchedulerOutput) -> None:
        """The step is done (``Scheduler.update`` ran): a decode-only step is
        an observation of what steps cost."""
        scheduled = out.scheduled
        if scheduled and all(s.num_new_tokens == 1 + len(s.draft_token_ids) for s in scheduled):
            self.cost.end(len(scheduled), sum(len(s.draft_token_ids) for s in scheduled))

    def forget(self, request_id: str) -> None:
        state = self._seqs.pop(request_id, None)
        if state is not None:
            self._backoff = state.backoff
        self.proposer.forget(request_id)


def speculates(request: Request) -> bool:
    """Whether the verifier can sample this sequence exactly as ``sample``
    would: it applies temperature, top-k, top-p, min-p and a structured
    output's grammar masks, not logprobs, penalties, logit biases, allowed
    tokens, bad words or the ``min_tokens`` bans."""
    p = request.params
    return (p.logprobs is None and not p.changes_logits
            and request.num_output_tokens >= p.min_tokens)
