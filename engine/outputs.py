"""What the engine hands back: one RequestOutput per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request. ``text`` and ``token_ids``
    are cumulative; ``delta_text`` and ``delta_token_ids`` are what is new
    since the previous output of this request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that matched
    # Per generated token: {token_id: logprob} of the sampled and top-N tokens.
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
