"""The proposer contract: what a speculative method must provide.

A proposer guesses the next few tokens of running sequences; the target
model then checks all of the guesses in one forward pass (engine/spec_decode/
verify.py) and keeps the longest prefix it agrees with, plus one token of its
own. A proposer can only cost speed, never correctness: whatever it
proposes, the output has the target model's distribution.

Contract for ``Proposer.propose``:

- It is called once per step, by the scheduler, before the step is built,
  with the sequences that may speculate (decoding, at most ``max_tokens``
  guesses each). It returns one ``Proposal`` per sequence, in order, with at
  most ``max_tokens`` token ids (none: do not speculate this step).
- It must not change the sequences. It may keep state per sequence id (a
  draft model's KV), which it drops in ``forget``; ``forget`` is called when
  a sequence finishes, is aborted or is preempted, and may name ids it has
  never seen.
- ``probs``: the distribution each proposed token was drawn from, ``[num
  proposed, vocab]``, or None when the proposal is deterministic (a point
  mass on each token, as for n-gram lookup or a greedy draft). The
  verifier's rejection rule depends on it.

A third method (EAGLE-style heads, MTP) is another subclass and a branch in
``engine/spec_decode/__init__.py``'s factory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DraftRequest:
    """One sequence to propose for: its tokens so far (prompt, then output;
    read-only) and the most tokens worth proposing."""

    request_id: str
    token_ids: list[int]
    max_tokens: int


@dataclass
class Proposal:
    token_ids: list[int]
    probs: Any = None  # torch.Tensor [len(token_ids), vocab] or None: point masses


class Proposer(ABC):
    name: str
    # A proposer that runs a model of its own: that model's LLMEngine (draft.py).
    engine: Any = None

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """One proposal per request, in order (see the module docstring)."""

    def forget(self, request_id: str) -> None:  # noqa: B027 (a stateless proposer keeps none)
        """Drop any state kept for ``request_id``."""

