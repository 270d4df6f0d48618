"""What the scheduler tells the model runner each step, and what it gets
back: plain data, no tensors and no live ``Request`` objects.

The runner keeps its own state for every request it has seen (tokens,
block table, sampling settings) and the scheduler sends only what changed:
a request the runner does not know yet comes whole, once, in
``new_requests``; after that each step names it with how many tokens to
compute and the blocks added to its table since the last step. Requests
that finished, were aborted or were preempted are listed in
``finished_ids`` so the runner drops them (a preempted request comes back
later as a new one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Everything the runner needs about a request it has no state for."""

    request_id: str
    token_ids: list[int]  # prompt and every output token so far (a copy)
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    index: int  # which of the request's n completions: seeds differ per completion
    block_ids: list[int]  # its block table so far
    # Prompt tokens that already have their logprob (a recompute after a
    # preemption scores only the missing ones).
    num_prompt_logprobs: int = 0
    bad_word_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized


@dataclass
class ScheduledRequest:
    """Compute ``num_new_tokens`` tokens of a request from position
    ``start``; the runner first writes ``new_block_ids`` into its block table
    from entry ``num_blocks_before`` on (the table can shrink: speculative
    slots that were rejected are given back).
    ``sample``: the chunk reaches the request's last token, so sample after it.
    ``draft_token_ids``: speculative decoding's proposal, the last
    ``len(draft_token_ids)`` of the new tokens (they follow the request's
    last token): verify them (engine/spec_decode/verify.py)."""

    request_id: str
    start: int
    num_new_tokens: int
    new_block_ids: list[int]
    sample: bool
    draft_token_ids: list[int] = field(default_factory=list)
    num_blocks_before: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Decodes (one new token each) first, then prefills and extends.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Gone since the last step (finished, aborted, preempted): the runner forgets them.
    finished_ids: list[str] = field(default_factory=list)
    # Preempted in this step (a subset of finished_ids): for metrics and tests.
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        n = 0
        for s in self.scheduled:
            if s.num_new_tokens != 1:
                break
            n += 1
        return n

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What one step produced, by request id."""

    sampled: dict[str, int] = field(default_factory=dict)
    # {token_id: logprob} of the sampled and top-N tokens, for requests that asked.
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # Prompt logprobs computed in this step, appended to what the request has.
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)
    # Sampled rows whose grammar allowed no token: no token, they finish (structured outputs).
    grammar_dead_ends: list[str] = field(default_factory=list)
    # Speculating requests (those scheduled with draft tokens): the tokens
    # verification kept, in order (accepted drafts, then the target's own).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
