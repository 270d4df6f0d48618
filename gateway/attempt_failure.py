"""What a failed call to a worker means for an attempt, decided here and
nowhere else: ``AttemptFailed`` when another worker may succeed (the
orchestrator retries, or migrates a stream that has tokens), or the
client's own error (``ValueError`` for INVALID_ARGUMENT, ...) when none
would. A failed KV handoff (a Prefill call ending with one of
pair_health's HANDOFF_FAILURES) is another pair's chance: it counts
against the pair (gateway/attempt.py), and the retry prefers other workers.
"""

from __future__ import annotations

import grpc

from gateway.pair_health import HANDOFF_FAILURES
from gateway.sequence import Sequence
from rpc.errors import Unavailable, from_rpc_error

# Status codes after which the same call may work on another worker.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}


class AttemptFailed(Exception):
    """The attempt failed in a way another worker may not: retry or migrate."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class NoWorkerAvailable(Unavailable):
    """No decode worker is in rotation at all (REST 503): not a full cluster
    (429), a missing one."""


def worker_failure(err: grpc.aio.AioRpcError, handoff: bool = False) -> Exception:
    """``handoff``: the failed call was a Prefill, which moves KV between
    two workers; a layout mismatch or a peer refused is the pair's fault."""
    if err.code() in RETRYABLE or (handoff and err.code() in HANDOFF_FAILURES):
        return AttemptFailed(err.code(), err.details() or "")
    return from_rpc_error(err)


def stop_if_aborted(seq: Sequence) -> None:
    """An Abort call that reached a worker before this attempt's call there
    found nothing to stop: the attempt stops itself at its next step (the
    orchestrator then aborts it everywhere and ends it with "abort")."""
    if seq.aborted:
        raise AttemptFailed(grpc.StatusCode.CANCELLED, "aborted")
