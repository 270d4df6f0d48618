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
top-p, min-p; engine/sampler.py ``probabilities``).

How the point-mass rule is drawn: with the sampler's own exponential race.
Row ``i``'s token is ``x_i = argmax(p_i / E_i)``, ``E_i ~ Exp(1)`` per
vocabulary entry, exactly the token ``sample`` would draw with that noise;
the draft is accepted when ``x_i == d_{i+1}``, and otherwise ``x_i`` is the
corrected token. ``P(x_i = d) = p(d)``, and given ``x_i != d``, ``x_i`` has
``p`` without ``d`` renormalised: the rule above, with one noise vector per
emitted token and nothing else. A seeded sequence draws each row's noise
from its own generator, in order, and only for the rows whose token it
emits, so its generator advances exactly as in plain sampling: the seed
gives the same text with and without speculation, in any batch, however
many guesses the drafter chose (engine/spec_decode/drafter.py may decide by
timing), up to float rounding that could tip a near tie between two tokens
(a verifying step's logits are not bit for bit a plain step's).

A draft that carries its distribution ``q`` (``draft_probs``; no proposer
here does yet) is verified by the general rule for unseeded sequences,
with uniform draws and a residual draw: it accepts ``sum min(p, q)`` of the
time, more than the race's ``sum p q``. A seeded one keeps the race, and
with it the one-noise-per-token property.
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
            out[id(s)] = _walk(s.draft, best[s.row : s.row + len(s.draft) + 1])
    if sampled:
        rows = torch.tensor([s.row + i for s in sampled for i in range(len(s.draft) + 1)],
                            device=device)
        batch = SamplingBatch.prepare(
            [s.request for s in sampled for _ in range(len(s.draft) + 1)],
            [s.generator for s in sampled for _ in range(len(s.draft) + 1)],
            vocab_size, device,
        )
        probs = probabilities(logits[rows], batch)  # [rows, vocab]
        spans, at = [], 0
        for s in sampled:
            spans.append((s, at, at + len(s.draft) + 1))
            at += len(s.draft) + 1
        # Unseeded point-mass rows: one race for all of them (their noise is
        # the global generator's; a row past a rejection wastes its draw).
        free = [(s, lo, hi) for s, lo, hi in spans if s.generator is None and s.draft_probs is None]
        if free:
            index = torch.tensor([r for _, lo, hi in free for r in range(lo, hi)], device=device)
            part = probs[index]
            raced = (part / torch.empty_like(part).exponential_()).argmax(dim=-1).tolist()
            at = 0
            for s, lo, hi in free:
                out[id(s)] = _walk(s.draft, raced[at : at + hi - lo])
                at += hi - lo
        for s, lo, hi in spans:
            if id(s) in out:
                continue
            if s.generator is None:  # a draft distribution, unseeded: the general rule
                out[id(s)] = _walk_rejection(s, probs[lo:hi])
            else:
                out[id(s)] = _walk_seeded(s, probs[lo:hi])
    return [out[id(s)] for s in seqs]


def _walk(draft: list[int], target: list[int]) -> list[int]:
    """``target[i]``: row ``i``'s token. Keep drafts while they match, then
    the first token that does not (or the bonus token after the last)."""
    tokens = []
    for d, t in zip(draft, target):
        tokens.append(t)
        if t != d:
            return tokens
    tokens.append(target[len(draft)])
    return tokens


def _walk_seeded(s: VerifyRows, probs: torch.Tensor) -> list[int]:
    """The race row by row with the sequence's generator, drawing noise only
    for the rows whose token is emitted (``probs``: [k + 1, vocab])."""
    tokens = []
    for i in range(len(s.draft) + 1):
        # NOTE: one vector per row as ``sample`` draws it (a [vocab] float32
        # row from the sequence's generator), so the generator stays in step.
        noise = torch.empty_like(probs[i]).exponential_(generator=s.generator)
        token = int((probs[i] / noise).argmax())
        tokens.append(token)
        if i == len(s.draft) or token != s.draft[i]:
            break
    return tokens


def _walk_rejection(s: VerifyRows, probs: torch.Tensor) -> list[int]:
    """Leviathan et al.'s rule for a draft drawn from ``q`` (``probs``: [k + 1, vocab])."""
    k = len(s.draft)
    draft = torch.tensor(s.draft, device=probs.device)
    p_d = probs[:-1].gather(1, draft[:, None]).squeeze(1)  # [k]
    q_d = s.draft_probs.gather(1, draft[:, None]).squeeze(1).float()
    uniform = torch.rand(k, device=probs.device)
    # accept d_i with probability min(1, p/q): u * q < p
    accepted = (uniform * q_d < p_d).tolist()
    tokens = []
    for i, ok in enumerate(accepted):
        if not ok:
            residual = (probs[i] - s.draft_probs[i].float()).clamp_(min=0)
            if residual.sum() <= 0:  # p == q exactly: nothing to correct towards
                residual = probs[i]
            tokens.append(_draw(residual))
            return tokens
        tokens.append(s.draft[i])
    tokens.append(_draw(probs[k]))
    return tokens


def _draw(weights: torch.Tensor) -> int:
    """A token with probability proportional to ``weights`` (the sampler's
    exponential race: argmax(w / E), E ~ Exp(1))."""
    noise = torch.empty_like(weights).exponential_()
    return int((weights / noise).argmax())
