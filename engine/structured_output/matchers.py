"""The runner's grammar state: one llguidance matcher per constrained
request in its persistent batch, and each step's token masks.

How a matcher follows a request: it is (re)built whenever the request
enters the runner (``NewRequestData``: first scheduled, after a preemption,
on a decode worker after the prefill worker sampled the first token, on the
decode worker a migrated request resumes on) from the spec in its sampling
params and the output tokens it already has. Nothing about grammar state
crosses the wire but the spec: a matcher advanced over the same tokens is
in the same state wherever it runs, so disaggregated, colocated and offline
runs constrain alike.

Per step: ``start`` computes the masks of the constrained rows on a helper
thread (llguidance drops the GIL) while the forward runs; ``banned`` waits
for them and returns the [rows, vocab] bool mask the sampler applies;
``accept`` advances each matcher by its sampled token. A speculating
request's draft is cut to what its grammar allows and each verified row
masked (``draft_masks``), so speculation keeps to the grammar too. A row
whose grammar allows no token is a dead end: the request ends with finish_reason
``grammar_dead_end`` rather than a token outside the grammar.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.scheduler_output import SchedulerOutput
from engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("engine")

CACHED_GRAMMARS = 128


def banned_tokens(mask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """The tokens a [rows, words] int32 bitmask (bit j of word w: token
    32w + j allowed) does not allow, as a [rows, vocab_size] bool tensor.
    NOTE: inverted word by word, then numpy's unpackbits, not torch shifts:
    no parallel region and no pass over the vocabulary but the one."""
    bits = np.unpackbits((~mask).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


class GrammarCache:
    """Compiled grammars per spec for one tokenizer: a pristine matcher each,
    copied for every request (a copy costs far less than compiling)."""

    def __init__(self, tokenizer: Any, capacity: int = CACHED_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        import llguidance

        pristine = self._compiled.get(spec.key)
        if pristine is None:
            pristine = llguidance.LLMatcher(self.tokenizer, spec.llg_grammar, log_level=0)
            self._compiled[spec.key] = pristine
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec.key)
        return pristine.deep_copy()

    def __len__(self) -> int:
        return len(self._compiled)


class GrammarMatchers:
    """Matchers of the runner's constrained requests, by request id."""

    def __init__(self, tokenizer_path: Path | None, vocab_size: int, threads: int = 2) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.threads = threads
        self.cache: GrammarCache | None = None  # made with the first constrained request
        self._matchers: dict[str, Any] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def update(self, out: SchedulerOutput) -> None:
        """Forget requests that are gone; build matchers for new ones."""
        for request_id in out.finished_ids:
            self._matchers.pop(request_id, None)
        for new in out.new_requests:
            spec = new.params.structured_outputs
            if spec is None:
                continue
            matcher = self._cache(new.eos_token_ids).matcher(spec)
            # Output tokens it already has (sampled on a prefill worker, by an
            # earlier attempt, or before a preemption) replay the grammar.
            outputs = new.token_ids[new.num_prompt_tokens:]
            if outputs and not matcher.consume_tokens(outputs):
                logger.warning("request %s: its tokens so far do not match its grammar: %s",
                               new.request_id, matcher.get_error())
            self._matchers[new.request_id] = matcher

    def start(self, request_ids: list[str]) -> Future | None:
        """Begin computing this step's masks for the rows ``request_ids``
        (the sampled requests in order); None when none is constrained."""
        rows = [(i, self._matchers[r]) for i, r in enumerate(request_ids) if r in self._matchers]
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._pool.submit(self._fill, rows, len(request_ids))

    def _fill(self, rows: list[tuple[int, Any]], num_rows: int) -> tuple[np.ndarray, list[int]]:
        import llguidance
        import llguidance.numpy as lnp

        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.threads)
        mask = np.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        live = [(m, i) for i, m in rows if not m.is_error()]
        if live:
            lnp.fill_next_token_bitmask_par(self._executor, live, mask)
        constrained = [i for i, _ in rows]
        dead = [i for i, m in rows if m.is_error()]
        return mask, [i for i in constrained if i in dead or not mask[i].any()]

    def banned(self, pending: Future | None) -> tuple[torch.Tensor | None, set[int]]:
        """The masks started by ``start``: a [rows, vocab] bool tensor (True:
        the grammar forbids the token) and the rows that are dead ends (left
        unmasked there: their token is discarded)."""
        if pending is None:
            return None, set()
        mask, dead = pending.result()
        banned = banned_tokens(mask, self.vocab_size)
        banned[dead] = False
        return banned, set(dead)

    def draft_masks(self, request_id: str, draft: list[int]) -> tuple[list[int], torch.Tensor]:
        """Speculative decoding: the longest prefix of ``draft`` the grammar
        allows from the request's state, and the [len(prefix) + 1, vocab]
        banned mask of the rows that verify it (row i: after the first i
        drafted tokens). The matcher is not advanced: ``accept`` the tokens
        verification keeps."""
        import llguidance
        import llguidance.numpy as lnp

        matcher = self._matchers[request_id]
        draft = draft[: matcher.validate_tokens(draft)] if not matcher.is_error() else []
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.threads)
        mask = np.zeros((len(draft) + 1, (self.vocab_size + 31) // 32), dtype=np.int32)
        if matcher.is_error():
            pass  # all banned: a dead end
        elif draft:
            lnp.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, [(matcher, 0, draft)], mask)
        else:  # the first drafted token is outside the grammar: one row
            lnp.fill_next_token_bitmask(matcher, mask, 0)
        return draft, banned_tokens(mask, self.vocab_size)

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's matcher by ``token``; False (and the matcher
        in error) when the grammar does not allow it. True when unconstrained."""
        matcher = self._matchers.get(request_id)
        return matcher is None or matcher.consume_token(token)

    def _cache(self, eos_token_ids: tuple[int, ...]) -> GrammarCache:
        if self.cache is None:
            import llguidance

            if self.tokenizer_path is None:
                raise ValueError("structured outputs need the model's tokenizer.json")
            tokenizer = llguidance.LLTokenizer(str(self.tokenizer_path), n_vocab=self.vocab_size,
                                               eos_token=list(eos_token_ids) or None)
            self.cache = GrammarCache(tokenizer)
        return self.cache

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
