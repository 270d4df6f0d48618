"""Prompt-lookup (n-gram) proposals: no model at all.

Take the last ``n`` tokens of a sequence, find the latest earlier place in
its prompt or output where the same ``n`` tokens occur, and propose the
tokens that followed them there. ``n`` goes from ``prompt_lookup_max`` down
to ``prompt_lookup_min``: a longer match is better evidence. It pays off
when the output copies its input (editing, summarising with quotes, code
rewrites, "repeat this text") and costs only the lookup when it does not.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.spec_decode.base import DraftRequest, Proposal, Proposer


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(self.lookup(r.token_ids, r.max_tokens)) for r in requests]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of
        the longest suffix of ``token_ids`` (of ``min_n``..``max_n`` tokens)."""
        num = len(token_ids)
        if k < 1 or num <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = tokens[num - n :]
            # Windows that start before the suffix does (the suffix matches itself).
            windows = sliding_window_view(tokens[: num - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # NOTE: the latest match: in generated text the most recent
                # context predicts the continuation best.
                start = int(hits[-1]) + n
                return token_ids[start : start + k]
        return []
