"""Verification: which proposed tokens the target model keeps.

The target ran one forward pass over ``[last token, d_1 .. d_k]`` of a
sequence, so row ``i`` of its logits is the target's distribution ``p_i``
for the token after ``d_i`` (row 0: after the last real token). Walking
``i = 0 .. k-1``, ``d_{i+1}`` is accepted or the walk stops with a token of
the target's own; if all ``k`` are accepted, a bonus token is drawn from
``p_k``. Every step thus yields between 1 and k + 1 tokens.

Greedy sequences: accept ``d`` while it is the target's argmax; the first
mismatch is replaced by the argmax. The output is the one greedy decoding
without speculation gives.

Sampled sequences: the rule of Leviathan et al. and Chen et al. (2023).
For a draft token ``d`` drawn from ``q``: accept with probability
``min(1, p(d) / q(d))``; on rejection draw from ``max(0, p - q)``
renormalised. Then for any token ``x``::

    P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) r(x)
         = min(p(x), q(x)) + max(0, p(x) - q(x))            [r = the residual]
         = p(x)

so each emitted token has the target's distribution, whatever ``q`` is.
With a point mass ``q = 1{d}`` (n-gram lookup, a greedy draft) this is:
accept ``d`` with probability ``p(d)``, and on rejection draw from ``p``
with ``d`` removed, renormalised: ``P(d) = p(d)`` and, for ``x != d``,
``P(x) = (1 - p(d)) p(x) / (1 - p(d)) = p(x)``.

``p`` is the distribution ``sample`` would draw from (temperature, top-k,
top-p, min-p; engine/sampler.py ``probabilities``). A seeded sequence draws
every random number from its own generator, so a seed gives the same text
alone or in any batch (not the same text as without speculation: the draws
are used differently).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import SamplingBatch, probabilities


@dataclass
class VerifyRows:
    """One speculating sequence: its sampling state (``params``), its
    proposal, and where its ``len(draft) + 1`` rows start in the logits."""

    request: object  # anything with .params, as SamplingBatch reads it
    draft: list[int]
    draft_probs: torch.Tensor | None  # [len(draft), vocab]; None: point masses
    generator: torch.Generator | None
    row: int


def verify(logits: torch.Tensor, seqs: list[VerifyRows], vocab_size: int) -> list[list[int]]:
    """The tokens each sequence emits this step (accepted drafts, then the
    target's own token). ``logits``: [rows, vocab], the rows of ``seqs``."""
    logits = logits.float()
    device = logits.device
    greedy = [s for s in seqs if s.request.params.greedy]
    sampled = [s for s in seqs if not s.request.params.greedy]
    out: dict[int, list[int]] = {}
    if greedy:
        best = logits.argmax(dim=-1).tolist()
        for s in greedy:
            out[id(s)] = _walk_greedy(s, best)
    if sampled:
        rows = torch.tensor([s.row + i for s in sampled for i in range(len(s.draft) + 1)],
                            device=device)
        batch = SamplingBatch.prepare(
            [s.request for s in sampled for _ in range(len(s.draft) + 1)],
            [s.generator for s in sampled for _ in range(len(s.draft) + 1)],
            vocab_size, device,
        )
        probs = probabilities(logits[rows], batch)  # [rows, vocab]
        at = 0
        for s in sampled:
            n = len(s.draft) + 1
            out[id(s)] = _walk_sampled(s, probs[at : at + n])
            at += n
    return [out[id(s)] for s in seqs]


def _walk_greedy(s: VerifyRows, best: list[int]) -> list[int]:
    tokens = []
    for i, d in enumerate(s.draft):
        target = best[s.row + i]
        tokens.append(target)
        if target != d:
            return tokens
    tokens.append(best[s.row + len(s.draft)])
    return tokens


def _walk_sampled(s: VerifyRows, probs: torch.Tensor) -> list[int]:
    """``probs``: [k + 1, vocab], the target's distribution at each row."""
    k = len(s.draft)
    draft = torch.tensor(s.draft, device=probs.device)
    p_d = probs[:-1].gather(1, draft[:, None]).squeeze(1)  # [k]
    q_d = torch.ones_like(p_d) if s.draft_probs is None else \
        s.draft_probs.gather(1, draft[:, None]).squeeze(1).float()
    uniform = torch.rand(k, generator=s.generator, device=probs.device)
    # accept d_i with probability min(1, p/q): u * q < p
    accepted = (uniform * q_d < p_d).tolist()
    tokens = []
    for i, ok in enumerate(accepted):
        if not ok:
            if s.draft_probs is None:
                residual = probs[i].clone()
                residual[s.draft[i]] = 0
            else:
                residual = (probs[i] - s.draft_probs[i].float()).clamp_(min=0)
            if residual.sum() <= 0:  # p == q exactly: nothing to correct towards
                residual = probs[i]
            tokens.append(_draw(residual, s.generator))
            return tokens
        tokens.append(s.draft[i])
    tokens.append(_draw(probs[k], s.generator))
    return tokens


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token with probability proportional to ``weights`` (the sampler's
    exponential race: argmax(w / E), E ~ Exp(1))."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
