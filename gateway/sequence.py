"""One completion as the gateway runs it, and the chunks it streams.

A request with ``n > 1`` runs as ``n`` sequences ``{id}-{i}`` with seed
``seed + i``, exactly as the engine forks them offline; ``fork`` is the one
place the gateway splits a request so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry import context as otel_context

from engine.completions import split_completions
from engine.sampling_params import SamplingParams
from gateway.state import State


@dataclass
class Chunk:
    """A piece of one completion, as the APIs stream it."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list = field(default_factory=list)  # TokenLogprobs protos
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list = field(default_factory=list)


@dataclass
class Sequence:
    request_id: str
    index: int
    prompt: list[int]
    params: SamplingParams
    sent: list[int] = field(default_factory=list)
    holders: set[str] = field(default_factory=set)  # worker addresses holding it now
    aborting: set[str] = field(default_factory=set)  # addresses an Abort has yet to reach
    attempt: int = 0
    record_id: str = ""  # the request's state record: its id without the -{index}
    trace_ctx: otel_context.Context | None = None  # parent of this sequence's spans
    aborted: bool = False  # by an Abort call: no retry, no migration
    outcome: State | None = None  # how this sequence itself ended

    @property
    def is_request(self) -> bool:
        """Whether this sequence is the whole request (n = 1), so that the
        request's record is its own."""
        return not self.record_id or self.record_id == self.request_id

    def abort_chunk(self) -> Chunk:
        """The last chunk of a sequence ended by an Abort call."""
        return Chunk(index=self.index, token_ids=[], text="", finish_reason="abort",
                     prompt_tokens=len(self.prompt))


def fork(request_id: str, prompt: list[int], params: SamplingParams,
         trace_ctx: otel_context.Context | None = None) -> list[Sequence]:
    """The sequences of one request, split as the engine splits its own
    (engine/completions.py): itself when ``n = 1``; otherwise ``n``
    sequences ``{request_id}#{i}`` of ``n = 1`` with seed ``seed + i``."""
    return [
        Sequence(seq_id, i, prompt, seq_params, record_id=request_id, trace_ctx=trace_ctx)
        for i, (seq_id, seq_params) in enumerate(split_completions(request_id, params))
    ]
