"""The engine's side of disaggregation: a request whose prompt KV is
computed elsewhere and written into blocks reserved here (a decode worker),
and a request whose KV others read as it is computed (a prefill worker).

A part of ``LLMEngine`` (engine/llm_engine.py), kept apart to read as one
concept; its methods run on the engine thread between steps, as all of the
engine's do, and use the engine's collaborators declared below and its
``validate``, ``_new_sequences``, ``_process`` and ``abort_request``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.layer_streams import LayerKVSink
from engine.outputs import KVProgress, RequestOutput
from engine.prompts import with_max_tokens
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.kv_cache_manager import KVCacheManager
    from engine.layer_streams import LayerStreams
    from engine.output_processor import OutputProcessor
    from engine.scheduler import Scheduler


class KVHandoff:
    scheduler: Scheduler
    kv: KVCacheManager
    output_processor: OutputProcessor
    layer_streams: LayerStreams
    max_model_len: int

    def reserve_remote(self, request_id: str, token_ids: Sequence[int],
                       params: SamplingParams) -> list[int] | None:
        """Reserve blocks for a one-sequence request whose prompt KV is
        computed elsewhere and written into them from outside.

        Returns the ids of the blocks to write, in token order, or None
        (nothing changed) when the cache has no room. The blocks are not in
        the prefix cache and no step touches them until ``start_remote``;
        ``abort_request`` frees them.
        """
        token_ids = list(token_ids)
        params = with_max_tokens(params, len(token_ids), self.max_model_len)
        self.validate(token_ids, params)
        if params.n != 1:
            raise ValueError("a reservation is for one sequence (n=1)")
        (request,) = self._new_sequences(request_id, token_ids, params)
        if not self.scheduler.reserve_remote(request):
            return None
        self.output_processor.add(request_id, None, [request])
        return self.kv.block_ids(request_id)

    def start_remote(self, request_id: str, first_token: int,
                     first_logprobs: dict[int, float] | None = None, *,
                     first_token_sent: bool = False) -> list[RequestOutput]:
        """The reserved blocks of ``request_id`` hold its prompt's KV now, and
        the prefill side sampled ``first_token``: publish the blocks to the
        prefix cache and queue the request for decoding (or finish it, if
        that token ended it). Returns the output carrying the first token.
        KeyError if the request holds no reservation.

        ``first_token_sent``: the caller already sent ``first_token`` (and
        its text) to the client: it is not output again, as for a migrated
        request's ``output_token_ids``. The returned output then carries no
        new token, and text the token left held back comes out, once, with
        a later one."""
        request = self.scheduler.remote.get(request_id)
        if request is None:
            raise KeyError(request_id)
        if first_logprobs is not None and request.params.logprobs is not None:
            request.logprobs.append(first_logprobs)
        request.first_token_time = time.monotonic()
        self.scheduler.start_remote(request_id, first_token)
        if first_token_sent:
            self.output_processor.skip_sent(request_id, 1)
        return self._process([request])

    def stream_layers(self, request_id: str, sink: LayerKVSink) -> None:
        """Tell ``sink`` (engine/layer_streams.py) layer by layer, on the
        engine thread and inside each step, which blocks of the prompt of
        ``request_id`` hold final KV, so that a transport can move layer
        ``i`` while layer ``i + 1`` computes. Call it right after
        ``add_request``, before the request's first step (in the same
        engine-thread call); the sink is dropped when the request finishes
        or is aborted. The blocks stay the request's to read only while it
        runs or holds them (``hold_blocks``); a sink that reads them later
        must finish before ``release``. KeyError if the request is unknown."""
        if request_id not in self.scheduler.requests:
            raise KeyError(request_id)
        self.layer_streams.add(request_id, sink)

    def kv_progress(self, request_id: str) -> KVProgress | None:
        """How far the KV of a request that runs here has got: its block
        ids, how many of them are fully computed, and whether it finished.
        None once it is gone or was aborted. The ids are safe to read until
        the next step (or, for a finished ``hold_blocks`` request, until it
        is released)."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status is RequestStatus.FINISHED_ABORTED:
            return None
        block_ids = self.kv.block_ids(request_id)
        done = len(block_ids) if request.finished else \
            request.num_computed_tokens // self.kv.block_size
        return KVProgress(block_ids, done, request.finished)

    def release(self, request_id: str) -> None:
        """Done with a request's blocks, whatever its state: a finished
        request that held them frees them; one that still runs is aborted.
        Unknown ids are ignored."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        self.layer_streams.drop(request_id)
        if request.finished:
            self.scheduler.release_held(request_id)
        else:
            self.abort_request(request_id)
