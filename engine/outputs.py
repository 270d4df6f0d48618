"""What the engine hands back: one RequestOutput per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec_decode.stats import SpecDecodeStats


class Logprob(float):
    """One token's log probability, with vLLM's ``Logprob`` attributes:
    ``logprob``, ``rank`` (1 for the most likely token of the vocabulary)
    and ``decoded_token`` (filled in by the offline ``LLM``; None elsewhere).
    A float, so code that reads logprobs as plain numbers keeps working."""

    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None,
                decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


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
    # Per generated token: {token_id: Logprob} of the sampled and top-N tokens.
    logprobs: list[dict[int, Logprob]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # The sum of the output tokens' logprobs, when ``logprobs`` was asked for.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """A method, as vLLM's is."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class KVProgress:
    """How far a request's KV has got on this engine (``LLMEngine.kv_progress``)."""

    block_ids: list[int]  # all of its blocks, in token order
    num_computed_blocks: int  # the leading blocks whose KV is complete
    finished: bool


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for routing and metrics."""

    num_running: int
    num_waiting: int  # queued, preempted, or reserved for remote KV
    num_requests: int  # requests not yet finished and collected, each of n sequences
    num_sequences: int  # sequences holding state (blocks, a queue slot or a reservation)
    num_blocks: int
    num_free_blocks: int
    kv_usage: float
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found
    num_steps: int = 0  # model steps run since start: grows while the engine makes progress
    # Speculative decoding's counters (engine/spec_decode/stats.py); None without it.
    spec_decode: SpecDecodeStats | None = None
    host_tier_restored_blocks: int = 0  # prefix-cache blocks copied back from host memory
    host_tier_bytes: int = 0  # bytes moved between the KV cache and the host tier, both ways
