"""Sampling in two calls: ``SamplingBatch.prepare`` builds the per-batch
tensors once, ``sample`` turns logits into tokens.

Seeded requests draw their noise from their own generator, a fixed amount per
token, so a seed gives the same tokens alone and inside any batch. Sampling
uses the exponential race (``argmax(p / q)`` with ``q ~ Exp(1)``), which
equals drawing from ``p`` and needs no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers import cpu_ops
from engine.outputs import Logprob
from engine.request import Request


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32, 1.0 for greedy rows (unused there)
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    all_greedy: bool
    generators: list[torch.Generator | None]
    requests: list[Request]
    max_logprobs: int  # top-N logprobs wanted by any row, -1 for none
    # [B, vocab] bool: tokens each row's grammar forbids (structured outputs); None: none.
    banned: torch.Tensor | None = None

    @classmethod
    def prepare(
        cls, requests: list[Request], generators: list[torch.Generator | None], vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        params = [r.params for r in requests]
        temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        greedy = [p.temperature == 0 for p in params]
        need_k = any(p.top_k > 0 for p in params)
        need_p = any(p.top_p < 1 for p in params)
        need_min_p = any(p.min_p > 0 for p in params)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=tensor(temps, torch.float32),
            greedy=tensor(greedy, torch.bool),
            top_k=tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64)
            if need_k else None,
            top_p=tensor([p.top_p for p in params], torch.float32) if need_p else None,
            min_p=tensor([p.min_p for p in params], torch.float32) if need_min_p else None,
            all_greedy=all(greedy),
            generators=generators,
            requests=requests,
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: Logprob} of the sampled token and the top-N, or None.
    logprobs: list[dict[int, Logprob] | None]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """``logits``: [B, vocab] in the model's dtype or float32, one row per
    request in ``batch``; sampled in float32."""
    rows = _penalized_rows(batch.requests)
    if (batch.all_greedy and batch.max_logprobs < 0 and batch.banned is None
            and not rows and logits.dtype == torch.bfloat16 and cpu_ops.supports(logits)):
        # Plain greedy rows of bfloat16 CPU logits: the argmax in one pass,
        # without widening them first (the same tokens).
        return SamplerOutput(cpu_ops.argmax(logits).tolist(), [None] * len(batch.requests))
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs >= 0 else None
    logits = _apply_penalties_and_bans(logits, batch.requests, rows)
    if batch.banned is not None:
        logits = logits.masked_fill(batch.banned, float("-inf"))

    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _sample_random(logits, batch)

    token_list = tokens.tolist()
    logprobs: list[dict[int, Logprob] | None] = [None] * len(token_list)
    if raw_logprobs is not None:
        logprobs = logprob_entries(raw_logprobs, tokens,
                                   [request.params.logprobs for request in batch.requests])
    return SamplerOutput(token_list, logprobs)


def logprob_entries(logprobs: torch.Tensor, tokens: torch.Tensor,
                    top_n: list[int | None]) -> list[dict[int, Logprob] | None]:
    """Per row of ``logprobs`` ([rows, vocab], log-softmaxed): the logprob
    of ``tokens[row]`` and of the row's ``top_n[row]`` most likely tokens
    (None: no entry for the row), each with its rank in the vocabulary (as
    vLLM counts it: the tokens at least as likely, itself included). Only
    the rows that ask are ranked: a rank reads the whole vocabulary."""
    entries: list[dict[int, Logprob] | None] = [None] * len(top_n)
    want = [row for row, n in enumerate(top_n) if n is not None]
    if not want:
        return entries
    if len(want) < len(top_n):
        logprobs, tokens = logprobs[want], tokens[want]
    chosen = logprobs.gather(1, tokens[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    chosen_vals = chosen.squeeze(1).tolist()
    most = max(top_n[row] for row in want)
    top_vals, top_ids = logprobs.topk(max(most, 1), dim=-1)
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for k, (row, token) in enumerate(zip(want, tokens.tolist())):
        n = top_n[row]
        entry = {token: Logprob(chosen_vals[k], ranks[k])}
        for rank, (tid, val) in enumerate(zip(top_ids[k][:n], top_vals[k][:n]), 1):
            entry.setdefault(tid, Logprob(val, rank))
        entries[row] = entry
    return entries


def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution ``sample`` draws a non-greedy row from (temperature,
    top-k, top-p, min-p; penalties are the caller's): speculative decoding's
    verifier (engine/spec_decode/verify.py) accepts against it."""
    logits = logits / batch.temperature[:, None]
    logits = _apply_top_k_top_p_min_p(logits, batch)
    return torch.softmax(logits, dim=-1)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    greedy_tokens = logits.argmax(dim=-1)
    probs = probabilities(logits, batch)
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(batch.generators) if g is None]
    if unseeded:
        if len(unseeded) == len(batch.generators):
            noise.exponential_()
        else:
            noise[unseeded] = torch.empty_like(noise[unseeded]).exponential_()
    for i, gen in enumerate(batch.generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.greedy, greedy_tokens, sampled)


def _apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.top_k is None and batch.top_p is None and batch.min_p is None:
        return logits
    if batch.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * batch.min_p[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if batch.top_k is None and batch.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if batch.top_k is not None:
        drop |= ranks >= batch.top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if batch.top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        before = probs.cumsum(dim=-1) - probs
        drop |= before >= batch.top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _apply_penalties_and_bans(logits: torch.Tensor, requests: list[Request],
                              rows: list[int] | None = None) -> torch.Tensor:
    """Repetition (over prompt and output, as in HF), presence and frequency
    penalties (over output, as in OpenAI), a logit bias, allowed tokens, bad
    words, and EOS/stop-token bans before ``min_tokens``, on ``rows``
    (``_penalized_rows``, found here if not given); the others are untouched."""
    if rows is None:
        rows = _penalized_rows(requests)
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        request, params, row = requests[i], requests[i].params, logits[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.long)
            seen = seen[seen < vocab].to(logits.device)
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
            )
        if (params.presence_penalty or params.frequency_penalty) and request.num_output_tokens:
            out = torch.tensor(request.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if params.logit_bias or params.allowed_token_ids is not None:
            row += _logit_offsets(request, row)
        if request.bad_word_ids:
            row[_completing(request.bad_word_ids, request, vocab)] = float("-inf")
        if request.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += list(request.eos_token_ids)
            banned = [t for t in banned if t < vocab]
            if banned:
                row[banned] = float("-inf")
    return logits


def _logit_offsets(request, row: torch.Tensor) -> torch.Tensor:
    """What ``logit_bias`` and ``allowed_token_ids`` add to a row of logits
    (-inf for a token not allowed): built once per request and kept on it,
    not from the parameters' lists at every step."""
    key = (row.shape[-1], row.dtype, row.device)
    cached = getattr(request, "logit_offsets", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    vocab, params = row.shape[-1], request.params
    offsets = torch.zeros_like(row)
    if params.logit_bias:
        for token, bias in params.logit_bias.items():
            if token < vocab:
                offsets[token] = bias
    if params.allowed_token_ids is not None:
        allowed = torch.full_like(row, float("-inf"))
        allowed[[t for t in params.allowed_token_ids if t < vocab]] = 0.0
        offsets += allowed
    request.logit_offsets = (key, offsets)
    return offsets


def _completing(words: list[list[int]], request: Request, vocab: int) -> list[int]:
    """The last tokens of ``words`` whose other tokens end the request's
    output (read in place: no copy of a long output every step)."""
    ids, room = request.token_ids, request.num_output_tokens + 1
    return [w[-1] for w in words if w[-1] < vocab and len(w) <= room
            and (len(w) == 1 or ids[len(ids) - len(w) + 1:] == w[:-1])]


def _penalized_rows(requests: list[Request]) -> list[int]:
    """Rows whose logits change (penalties, a bias, allowed tokens, bad
    words), or with an EOS/stop-token ban until ``min_tokens``."""
    return [
        i for i, r in enumerate(requests)
        if r.params.changes_logits or r.num_output_tokens < r.params.min_tokens
    ]
