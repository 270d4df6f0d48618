"""One sequence being generated: its tokens and how far the KV cache has got.

The scheduler works by token progress: ``num_computed_tokens`` chases
``num_tokens``. A fresh prompt, a chunked prefill, a prefix-cache hit, a
preempted request recomputing, and KV that arrived from a prefill worker are
all just different values of ``num_computed_tokens``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Blocks are reserved; the prompt's KV is arriving from a prefill worker.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Structured outputs: the grammar allowed no next token.
    FINISHED_GRAMMAR = "grammar_dead_end"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_GRAMMAR,
        )


class TokenCounts:
    """What derives from a sequence's tokens (prompt, then output) and its
    prompt's length: shared by the scheduler's ``Request`` and the runner's
    own copy of it (engine/batch.py), which store only those two."""

    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(eq=False)
class Request(TokenCounts):
    """A single sequence. A request with ``n > 1`` is ``n`` of these that
    share the prompt's blocks (see ``Scheduler.fork``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    # The index of this completion among the n of its parent request.
    index: int = 0
    parent_id: str | None = None

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache the first time it was scheduled.
        self.num_cached_tokens = 0
        # Chained digests of this request's full blocks, grown as blocks fill
        # (engine/prefix_hash.py).
        self.block_hashes: list[bytes] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Per generated token: {token_id: logprob} for the sampled and top-N tokens.
        self.logprobs: list[dict[int, float]] = []
        # Per prompt token (the first is None): {token_id: logprob}.
        self.prompt_logprobs: list[dict[int, float] | None] = []
        # Children waiting for this request's prompt to be computed (n > 1).
        self.pending_children: list[Request] = []
        # Keep the blocks after finishing, until released (a prefill worker
        # holds them until the decode side has the KV).
        self.hold_blocks = False
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # ``params.bad_words`` as token ids (set by the engine, which has the tokenizer).
        self.bad_word_ids: list[list[int]] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
