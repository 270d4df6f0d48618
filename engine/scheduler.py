"""Continuous batching: one scheduler for prefill, decode and everything between.

Every step each request asks for ``num_tokens - num_computed_tokens`` more
tokens; the scheduler grants what the token budget and the free blocks allow,
running requests first (oldest first), then waiting ones in arrival order.
When blocks run out, the newest running request is preempted: its blocks are
freed and it recomputes later (tokens generated so far are kept).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import TYPE_CHECKING

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler_output import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from engine.spec_decode.drafter import SpecDecoder


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 spec: SpecDecoder | None = None):
        self.config = config
        # Speculative decoding (engine/spec_decode/), or None.
        self.spec = spec
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Blocks reserved, KV arriving from elsewhere; joins `waiting` when complete.
        self.remote: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        # Requests the model runner holds state for, and those it should
        # forget at the next step (see scheduler_output.py).
        self._in_runner: set[str] = set()
        self._gone: list[str] = []

    # ---- admission -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve_remote(self, request: Request) -> bool:
        """Reserve blocks for a fresh request whose prompt's KV will arrive
        from a prefill worker. False, changing nothing, if there is no room."""
        ok = self.kv.reserve(request, request.num_prompt_tokens)
        if ok:
            request.num_computed_tokens = request.num_prompt_tokens
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
            self.requests[request.request_id] = request
            self.remote[request.request_id] = request
        return ok

    def remote_kv_arrived(self, request_id: str) -> None:
        """The reserved blocks hold their KV now: the request can decode."""
        request = self.remote.pop(request_id)
        self.kv.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def start_remote(self, request_id: str, first_token: int) -> Request:
        """A reserved request's KV arrived and the prefill worker sampled
        ``first_token``: append it, and either finish (it ended the request)
        or queue the request for decoding."""
        request = self.remote[request_id]
        request.append_token(first_token)
        self.check_stop(request, first_token)
        if request.finished:
            del self.remote[request_id]
            self._release(request)
        else:
            self.remote_kv_arrived(request_id)
        return request

    # ---- one step --------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput()
        now = time.monotonic()
        proposals = self.spec.propose(self.running) if self.spec is not None else {}

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_left = request.num_tokens - request.num_computed_tokens
            proposal = proposals.get(request.request_id)
            draft = proposal.token_ids if proposal is not None else []
            num_new = self._chunk(num_left + len(draft), budget)
            draft = draft[: max(num_new - num_left, 0)]  # what the budget leaves room for
            num_held = self.kv.num_held(request.request_id)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, request.num_computed_tokens,
                                                     num_new, num_held, draft))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing after it fits either

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if out.preempted and self.running:
                break  # blocks are short: let running requests drain first
            request = self.waiting[0]
            hits, num_hit = [], 0
            if request.num_computed_tokens == 0:
                hits, num_hit = self.kv.get_computed_blocks(request)
            start = request.num_computed_tokens + num_hit
            num_new = self._chunk(request.num_tokens - start, budget)
            num_held = self.kv.num_held(request.request_id)
            if not self.kv.allocate_slots(request, num_new, hits):
                if self.running or out.scheduled or not self._free_queued(request):
                    break
                continue  # the same request again, with the blocks just freed
            self.waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = start
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.request_id not in self._in_runner:
                self._in_runner.add(request.request_id)
                out.new_requests.append(self._new_request_data(request))
                num_held = None  # the new data carries the whole table
            out.scheduled.append(self._scheduled(request, start, num_new, num_held))
            budget -= num_new

        # Single-token sequences first: the attention backend reads them as decodes.
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        out.finished_ids, self._gone = self._gone, []
        return out

    def _scheduled(self, request: Request, start: int, num_new: int,
                   num_held: int | None, draft: list[int] | None = None) -> ScheduledRequest:
        """``num_held``: table entries the runner has; None: it has them all.
        ``draft``: proposed tokens, the last of the ``num_new``."""
        draft = draft or []
        new_ids = [] if num_held is None else self.kv.block_ids(request.request_id, num_held)
        return ScheduledRequest(request.request_id, start, num_new, new_ids,
                                sample=start + num_new - len(draft) == request.num_tokens,
                                draft_token_ids=draft, num_blocks_before=num_held or 0)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id, token_ids=list(request.token_ids),
            num_prompt_tokens=request.num_prompt_tokens, params=request.params,
            eos_token_ids=request.eos_token_ids, index=request.index,
            block_ids=self.kv.block_ids(request.request_id),
            num_prompt_logprobs=len(request.prompt_logprobs),
            bad_word_ids=request.bad_word_ids,
        )

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance progress after the model ran; append sampled tokens (and
        logprobs); finish requests that hit a stop condition. Returns the
        requests that changed (got a token or finished)."""
        changed, dead_ends = [], []
        for request_id, entries in result.prompt_logprobs.items():
            self.requests[request_id].prompt_logprobs.extend(entries)
        for s in out.scheduled:
            request = self.requests[s.request_id]
            if s.draft_token_ids:
                if request.request_id in result.grammar_dead_ends:
                    dead_ends.append(request)  # its grammar allows no token: it ends (below)
                    continue
                self._accept(request, s, result.spec_tokens[request.request_id])
                changed.append(request)
                continue
            request.num_computed_tokens = s.end
            if not s.sample:
                continue
            if request.request_id in result.grammar_dead_ends:  # no token: it ends (below)
                dead_ends.append(request)
                continue
            token = result.sampled[request.request_id]
            request.append_token(token)
            logprobs = result.logprobs.get(request.request_id)
            if logprobs is not None:
                request.logprobs.append(logprobs)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            if request.pending_children:
                self._fork_children(request)
            self.check_stop(request, token)
            changed.append(request)
        finished = [r for r in changed if r.finished]
        if finished:
            # One pass over `running`, not a list.remove per finished request.
            self.running = [r for r in self.running if not r.finished]
            for request in finished:
                self._release(request)
        for request in dead_ends:  # structured outputs: the grammar allowed no token
            # NOTE: at its first token, n > 1 siblings not forked yet end with
            # it: they would meet the same grammar at the same place.
            changed += [request, *request.pending_children]
            self.finish(request.request_id, RequestStatus.FINISHED_GRAMMAR)
        if self.spec is not None:
            self.spec.end_step(out)  # what the step cost: when speculation pays (drafter.py)
        return changed

    def _accept(self, request: Request, s: ScheduledRequest, tokens: list[int]) -> None:
        """Append what verifying ``s``'s proposal kept (accepted drafts, then
        the target's own token), stopping at the first token that ends the
        request, and roll back the rest.

        Rollback: KV is valid up to the last accepted draft, so every token
        but the last new one is computed; slots past that hold rejected
        drafts' KV and are rewritten next step. The blocks that held only
        rejected tokens go back to the pool. The prefix cache never saw
        them: ``allocate_slots`` publishes full blocks of the request's own
        tokens only, and drafts are not among them until accepted."""
        self.spec.observe(request.request_id, len(s.draft_token_ids), len(tokens) - 1)
        for token in tokens:
            request.append_token(token)
            self.check_stop(request, token)
            if request.finished:
                break
        request.num_computed_tokens = request.num_tokens - 1
        if not request.finished:
            self.kv.trim(request, request.num_tokens)

    # ---- finishing ---------------------------------------------------------

    def finish(self, request_id: str, status: RequestStatus, reason: str | None = None) -> None:
        """Finish a request from outside (abort, or a stop string matched)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.finished:  # finished before, its blocks held: an abort frees them
            if status is RequestStatus.FINISHED_ABORTED:
                self.release_held(request_id)
            return
        if status is RequestStatus.FINISHED_ABORTED:
            request.hold_blocks = False
        for child in request.pending_children:
            child.status = status  # not forked yet: nothing held, nowhere queued
        request.pending_children = []
        request.status = status
        request.stop_reason = reason
        if request in self.running:
            self._remove_running(request)
        elif request_id in self.remote:
            del self.remote[request_id]
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self._release(request)

    def release_held(self, request_id: str) -> None:
        """Free the blocks of a finished request that held them (``hold_blocks``)."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.kv.free(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, num_left: int, budget: int) -> int:
        """How many of a request's ``num_left`` tokens to compute this step."""
        cap = self.config.long_prefill_token_threshold
        return min(num_left, budget, cap if cap is not None else num_left)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.remote)

    def backlogged(self, share: float = 1.0) -> bool:
        """Whether the queued and the running requests have ``share`` of a
        step's budget of tokens or more to compute (1: a whole step)."""
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        left = self.config.max_num_batched_tokens * share
        for request in itertools.chain(self.running, self.waiting):
            left -= request.num_tokens - request.num_computed_tokens
            if left <= 0:
                return True
        return False

    # ---- internals -----------------------------------------------------------

    def check_stop(self, request: Request, token: int) -> None:
        """Finish ``request`` if ``token`` (just appended) ends it."""
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH

    def _fork_children(self, parent: Request) -> None:
        # Share the full blocks of the prompt, short of the block holding the
        # last prompt token: each child computes that token itself for its
        # own first sample, and never writes into a shared block.
        shared = (parent.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size
        for child in reversed(parent.pending_children):
            self.kv.fork(parent, child, shared)
            self.requests[child.request_id] = child
            self.waiting.appendleft(child)
        parent.pending_children = []

    def _free_queued(self, head: Request) -> bool:
        """Nothing runs, and ``head`` cannot get its blocks: free those of
        the newest request queued behind it that holds any (a forked
        sibling's share of the prompt, KV that arrived from a prefill
        worker); it computes them again in its turn. Without this the engine
        stopped for good, every free block too few for the head and nothing
        left to finish and free more. False if none holds any."""
        for request in reversed(self.waiting):
            if request is not head and self.kv.num_held(request.request_id):
                self._preempt(request, requeue=False)
                return True
        return False

    def _preempt(self, request: Request, requeue: bool = True) -> None:
        """Free ``request``'s blocks; it computes its tokens again later.
        ``requeue``: it was running, and goes to the front of the queue
        (False: it is queued already, and keeps its place)."""
        self._forget(request)
        if self.spec is not None:
            self.spec.forget(request.request_id)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        if requeue:
            self.waiting.appendleft(request)

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)

    def _forget(self, request: Request) -> None:
        """The runner drops its state for ``request`` at the next step."""
        if request.request_id in self._in_runner:
            self._in_runner.discard(request.request_id)
            self._gone.append(request.request_id)

    def _release(self, request: Request) -> None:
        self._forget(request)
        if self.spec is not None:
            self.spec.forget(request.request_id)
        if request.hold_blocks:
            return
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
