"""The scheduler's side of speculation: which sequences speculate this step,
how many tokens each may guess, and turning speculation off where it does
not pay.

A sequence speculates when it is decoding (one token left to compute), its
sampling needs nothing the verifier does not do (no logprobs, no
penalties, ``min_tokens`` reached), and it has room: a guess past
``max_tokens`` or the model's length would be thrown away, so the cap also
keeps a sequence within the blocks ``LLMEngine.validate`` promised it.

How many tokens to guess (auto-off included). A step costs about
``F + r * rows``: ``F`` the part every step pays (reading the weights,
launching), ``r`` each row of tokens. The ``i``-th guess of a sequence costs
a row and, if it and the guesses before it are accepted, saves a whole
token: ``F / B + r`` at batch ``B``. With ``a`` the sequence's running
acceptance rate, the ``i``-th guess pays when ``a^i >= r / (F / B + r) = B
/ (B + F / r)``. So a sequence proposes the longest run that pays: at batch
1 nearly any acceptance is worth a guess (a decode is memory-bound), at
large batches only runs that are nearly always right (compute dominates).
When not even one guess pays, the sequence pauses (4 steps, doubling up to
64 while it keeps failing), then probes with one guess, which can bring
its rate back up. An n-gram lookup that finds nothing proposes nothing, so
text that does not repeat costs the lookups only.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.spec_decode.base import DraftRequest, Proposal, Proposer
from engine.spec_decode.stats import SpecDecodeStats

# NOTE: F / r for SmolLM2-135M in float32 on one CPU core, set from what
# speculation cost end to end (docs/benchmarks.md): a step is not linear in
# its rows. At batch 1 a decode step took 52 ms of CPU and 4 extra rows 38 ms
# more (the LM head's matmul is most of a row); at batch 16 the rows past 16
# start a new GEMM block and cost nearly a token each, so there only runs
# that are almost always right pay. 3 gives a threshold of 0.25 at batch 1
# and 0.84 at batch 16. On a GPU a decode step is memory-bound until batches
# of tens of sequences, so F / r is far larger.
FIXED_TO_ROW = {"cpu": 3.0, "cuda": 64.0}
EMA = 0.5  # weight of the newest proposal in the running acceptance rate
BACKOFF_STEPS = 4
MAX_BACKOFF = 64


@dataclass
class _SeqState:
    # Running acceptance rate. NOTE: it starts at 0.7, not 1: at batch 16 a
    # new sequence then probes with one guess rather than k that may all miss.
    acceptance: float = 0.7
    pause: int = 0  # steps left without speculating
    backoff: int = BACKOFF_STEPS


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int,
                 device: str = "cpu"):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.fixed_to_row = FIXED_TO_ROW["cuda" if device.startswith("cuda") else "cpu"]
        self.stats = SpecDecodeStats()
        self._seqs: dict[str, _SeqState] = {}

    def propose(self, running: list[Request]) -> dict[str, Proposal]:
        """Proposals for the running sequences that speculate this step."""
        k = self.config.num_speculative_tokens
        decoding = [r for r in running
                    if r.num_computed_tokens == r.num_tokens - 1 and speculates(r)]
        threshold = len(decoding) / (len(decoding) + self.fixed_to_row)
        # NOTE: a seeded sequence decides as if alone: how many guesses it
        # makes decides which random draws it uses, and a seed must give the
        # same text in any batch.
        alone = 1 / (1 + self.fixed_to_row)
        asks = []
        for r in decoding:
            room = min(k, r.params.max_tokens - r.num_output_tokens - 1,
                       self.max_model_len - r.num_tokens)
            state = self._seqs.setdefault(r.request_id, _SeqState())
            length = self._length(state, room, alone if r.params.seed is not None else threshold)
            if length:
                asks.append(DraftRequest(r.request_id, r.token_ids, length))
        if not asks:
            return {}
        proposals = self.proposer.propose(asks)
        return {a.request_id: p for a, p in zip(asks, proposals, strict=True) if p.token_ids}

    def _length(self, state: _SeqState, room: int, threshold: float) -> int:
        """The longest run of guesses that pays (module docstring), or 0."""
        if room < 1:
            return 0
        if state.pause:
            state.pause -= 1
            return 0
        length = 0
        while length < room and state.acceptance ** (length + 1) >= threshold:
            length += 1
        if not length:
            state.pause = state.backoff
            state.backoff = min(2 * state.backoff, MAX_BACKOFF)
            state.acceptance = threshold  # after the pause, probe with one guess
        return length

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """A proposal of ``num_draft`` tokens was verified; ``num_accepted`` held."""
        self.stats.observe(num_draft, num_accepted)
        state = self._seqs.setdefault(request_id, _SeqState())
        state.acceptance = (1 - EMA) * state.acceptance + EMA * num_accepted / num_draft
        if num_accepted:
            state.backoff = BACKOFF_STEPS

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self.proposer.forget(request_id)


def speculates(request: Request) -> bool:
    """Whether the verifier can sample this sequence exactly as ``sample``
    would: it applies temperature, top-k, top-p, min-p and a structured
    output's grammar masks, not logprobs, penalties or the ``min_tokens`` bans."""
    p = request.params
    return (p.logprobs is None and not p.has_penalties
            and request.num_output_tokens >= p.min_tokens)
