"""A request's state records, written as its sequences move on.

With ``n = 1`` the request has one record, fenced on the sequence's
attempts. With ``n > 1`` each sequence ``{id}-{i}`` has a record of its own,
fenced on its own attempts (one completion's retry must not silence the
others' writes); the request's record follows the latest change of any of
them unfenced (attempt 0) and ends with the request's outcome and the total
of tokens sent. The store drops a write older than the stored attempt. The sampling
parameters are stored once, on the request's record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from engine.sampling_params import SamplingParams
from gateway.router import WorkerView
from gateway.sequence import Sequence
from gateway.state import State, StateStore

logger = logging.getLogger("gateway")


class RequestRecords:
    def __init__(self, store: StateStore) -> None:
        self.store = store

    async def open(self, request_id: str, prompt: list[int], params: SamplingParams,
                   seqs: list[Sequence]) -> None:
        """The request's record in state QUEUED, and its sequences' ones."""
        record = {"prompt_tokens": len(prompt), "params": json.dumps(dataclasses.asdict(params)),
                  "tokens_sent": 0, "n": params.n}
        await self.store.create(request_id, record)
        if len(seqs) > 1:  # the parameters are the request's, stored once, there
            await asyncio.gather(*(
                self.store.create(s.request_id, {"prompt_tokens": len(prompt), "tokens_sent": 0,
                                                 "n": 1, "index": s.index, "parent": request_id})
                for s in seqs
            ))

    async def state(self, seq: Sequence, state: State, decode: WorkerView | None = None,
                    prefill: WorkerView | None = None) -> None:
        """``seq`` moved to ``state`` in its current attempt (on these workers)."""
        fields: dict = {"state": state, "tokens_sent": len(seq.sent)}
        if decode is not None:
            fields["decode_worker"] = decode.worker_id or decode.address
        if prefill is not None:
            fields["prefill_worker"] = prefill.worker_id or prefill.address
        if not seq.is_request:
            await self.store.update(seq.request_id, seq.attempt, fields)
            fields = {"state": state}  # a sequence's count is not the request's
        await self.store.update(seq.record_id or seq.request_id, _request_attempt(seq), fields)

    async def close(self, request_id: str, seqs: list[Sequence], state: State) -> None:
        """The request ended in ``state``; each sequence as it ended itself.
        Never raises: a store that fails here is logged."""
        end = f"{time.time():.3f}"
        writes = [(request_id, _request_attempt(seqs[0]), state, sum(len(s.sent) for s in seqs))]
        if len(seqs) > 1:
            writes += [(s.request_id, s.attempt, s.outcome or state, len(s.sent)) for s in seqs]
        for record_id, attempt, final, sent in writes:
            try:
                await self.store.update(record_id, attempt, {
                    "state": final, "tokens_sent": sent, "finished": end})
            except Exception:
                logger.exception("could not record the end of %s", record_id)


def _request_attempt(seq: Sequence) -> int:
    """The attempt a write to the request's record carries: the sequence's
    own when it is the request (n = 1); 0 when the record summarises several
    sequences, whose fencing is on their own records."""
    return seq.attempt if seq.is_request else 0
