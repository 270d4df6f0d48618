"""What the scheduler decides for one step: plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class ScheduledRequest:
    """Compute ``num_new_tokens`` tokens of ``request`` starting at position
    ``start``; sample after the last one when ``sample`` is true."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def sample(self) -> bool:
        return self.start + self.num_new_tokens == self.request.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    # Decodes (one new token each) first, then prefills and extends.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
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
