"""The ``n`` completions of one request: the one rule for splitting it.

Completion ``i`` of ``n`` is a sequence of its own with ``n = 1`` and, when
the request is seeded, seed ``seed + i`` (wrapped as a signed 64-bit
integer, so every valid seed has its ``n`` valid ones). The engine runs them side by side
(sharing the prompt's blocks); the gateway spreads them over workers as
requests of their own. Both split here, so a seed gives the same ``n``
completions either way. With ``n = 1`` the sequence is the request itself;
otherwise sequence ``i`` is ``{request_id}-{i}``.

Torch-free: the gateway imports it.
"""

from __future__ import annotations

import dataclasses

from engine.sampling_params import SamplingParams

# Between a request's id and its completion's index in a sequence id. Ids a
# caller chooses may not contain it (the gateway's gRPC API refuses them), so
# no request's id is ever another's sequence id.
SEQUENCE_SEPARATOR = "#"


def split_completions(request_id: str,
                      params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """``(sequence id, its own params)`` for each completion, in index order:
    the request's own id when ``n = 1``, else ``{request_id}#{i}``."""
    if params.n == 1:
        return [(request_id, params)]
    return [
        (f"{request_id}{SEQUENCE_SEPARATOR}{i}", dataclasses.replace(
            params, n=1, seed=None if params.seed is None else _int64(params.seed + i)))
        for i in range(params.n)
    ]


def _int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63
