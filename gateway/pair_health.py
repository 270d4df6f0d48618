"""Prefill -> decode pairs whose KV handoff keeps failing, kept apart a while.

Two workers can each answer every poll and still be unable to hand KV to each
other: a firewall or a broken route between their hosts (mooncake, torch),
a prefill worker whose ``--peer`` list leaves the decode worker out, two KV
layouts that differ in the middle of a rolling update. Without this, every
request routed to such a pair paid a failed attempt, and its retries went
back to it: the decode worker that cannot receive has the most free blocks,
so it is the first candidate every time, and a request failed outright once
its attempts ran out.

After ``FAILURES_TO_PART`` handoffs in a row fail between two workers, the
pair is kept apart for ``COOLDOWN_S`` (twice as long each time it fails again,
up to ``MAX_COOLDOWN_S``). Then it is on trial: requests use it again, and
the first failure parts it again while a success clears it. Meanwhile a
request for that decode worker takes another prefill worker, or, when none
is left, the decode worker computes the prompt itself (gateway/attempt.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc

logger = logging.getLogger("gateway")

FAILURES_TO_PART = 2
COOLDOWN_S = 5.0
MAX_COOLDOWN_S = 60.0

# A Prefill call that ends with one of these failed between the two workers
# (or in the prefill worker itself, which its polls notice too). Not here:
# the request's own faults, a full worker (RESOURCE_EXHAUSTED), an attempt
# the gateway gave up on or a lease that ran out (ABORTED, NOT_FOUND,
# CANCELLED).
HANDOFF_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
})


@dataclass
class _Pair:
    failures: int = 0  # in a row
    apart_until: float = 0.0  # monotonic; 0: together
    cooldown_s: float = 0.0  # of the last parting (0: never parted since the last success)


class PairHealth:
    def __init__(self, cooldown_s: float = COOLDOWN_S,
                 max_cooldown_s: float = MAX_COOLDOWN_S) -> None:
        self.cooldown_s, self.max_cooldown_s = cooldown_s, max_cooldown_s
        self._pairs: dict[tuple[str, str], _Pair] = {}

    def apart(self, prefill: str, decode: str) -> bool:
        """Whether a request must not pair these two now."""
        pair = self._pairs.get((prefill, decode))
        return pair is not None and pair.apart_until > time.monotonic()

    def failed(self, prefill: str, decode: str, why: str) -> None:
        pair = self._pairs.setdefault((prefill, decode), _Pair())
        if pair.apart_until > time.monotonic():
            return  # a request that started before the pair was parted
        pair.failures += 1
        on_trial = pair.cooldown_s > 0
        if pair.failures < FAILURES_TO_PART and not on_trial:
            return
        pair.cooldown_s = (min(pair.cooldown_s * 2, self.max_cooldown_s) if on_trial
                           else self.cooldown_s)
        pair.apart_until = time.monotonic() + pair.cooldown_s
        pair.failures = 0
        logger.warning("KV handoff from %s to %s failed (%s): not paired for %.0f s",
                       prefill, decode, why, pair.cooldown_s)

    def succeeded(self, prefill: str, decode: str) -> None:
        pair = self._pairs.pop((prefill, decode), None)
        if pair is not None and pair.cooldown_s:
            logger.info("KV handoff from %s to %s works again", prefill, decode)

    def forget(self, address: str) -> None:
        """A worker left for good: its pairs go with it."""
        for key in [key for key in self._pairs if address in key]:
            del self._pairs[key]

    def apart_now(self) -> list[tuple[str, str]]:
        """The (prefill, decode) addresses kept apart now."""
        now = time.monotonic()
        return [key for key, p in self._pairs.items() if p.apart_until > now]
