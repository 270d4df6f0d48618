"""The scheduler's side of speculation: which sequences speculate this step,
how many tokens each may guess, and turning speculation off where it does
not pay.

A sequence speculates when it is decoding (one token left to compute), its
sampling needs nothing the verifier does not do (no logprobs, no
penalties, ``min_tokens`` reached), and it has room: a guess past
``max_tokens`` or the model's length would be thrown away, so the cap also
keeps a sequence within the blocks ``LLMEngine.validate`` promised it.

Auto-off: each sequence keeps a running acceptance rate of its proposals.
When it falls below ``MIN_ACCEPTANCE`` the sequence stops speculating for a
while (``BACKOFF_STEPS``, doubled each time it collapses again, up to
``MAX_BACKOFF``), so text that does not repeat costs the lookups and the
occasional probe, not a verification of k rejected tokens every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.spec_decode.base import DraftRequest, Proposal, Proposer
from engine.spec_decode.stats import SpecDecodeStats

# NOTE: the break-even of a verification on a CPU at low batch is far below
# this (an extra query token costs a few percent of a step); the floor is
# for large batches, where k rejected tokens per sequence are real compute.
MIN_ACCEPTANCE = 0.2
EMA = 0.5  # weight of the newest proposal in the running acceptance rate
BACKOFF_STEPS = 4
MAX_BACKOFF = 64


@dataclass
class _SeqState:
    acceptance: float = 1.0  # running acceptance rate (optimistic start)
    pause: int = 0  # steps left without speculating
    backoff: int = BACKOFF_STEPS


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        self._seqs: dict[str, _SeqState] = {}

    def propose(self, running: list[Request]) -> dict[str, Proposal]:
        """Proposals for the running sequences that speculate this step."""
        k = self.config.num_speculative_tokens
        asks = []
        for r in running:
            if r.num_computed_tokens != r.num_tokens - 1 or not speculates(r):
                continue
            state = self._seqs.setdefault(r.request_id, _SeqState())
            if state.pause:
                state.pause -= 1
                continue
            room = min(k, r.params.max_tokens - r.num_output_tokens - 1,
                       self.max_model_len - r.num_tokens)
            if room >= 1:
                asks.append(DraftRequest(r.request_id, r.token_ids, room))
        if not asks:
            return {}
        proposals = self.proposer.propose(asks)
        return {a.request_id: p for a, p in zip(asks, proposals, strict=True) if p.token_ids}

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """A proposal of ``num_draft`` tokens was verified; ``num_accepted`` held."""
        self.stats.observe(num_draft, num_accepted)
        state = self._seqs.setdefault(request_id, _SeqState())
        state.acceptance = (1 - EMA) * state.acceptance + EMA * num_accepted / num_draft
        if state.acceptance < MIN_ACCEPTANCE:
            state.pause = state.backoff
            state.backoff = min(2 * state.backoff, MAX_BACKOFF)
            state.acceptance = MIN_ACCEPTANCE  # a probe after the pause can lift it again
        elif num_accepted:
            state.backoff = BACKOFF_STEPS

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self.proposer.forget(request_id)


def speculates(request: Request) -> bool:
    """Whether the verifier can sample this sequence exactly as ``sample``
    would: it applies temperature, top-k, top-p and min-p, not logprobs,
    penalties or the ``min_tokens`` bans."""
    p = request.params
    return (p.logprobs is None and not p.has_penalties
            and request.num_output_tokens >= p.min_tokens)
