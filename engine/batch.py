"""The runner's persistent batch, and one step's inputs built from it.

``InputBatch`` keeps a row per request the runner knows (its tokens, its
block table in one preallocated array, its sampling settings) and is updated
from each SchedulerOutput's deltas, so a step's host work grows with what
changed, not with every request's whole context.

``StepBatch`` holds exactly what the model's forward pass needs (token ids,
positions, slot mapping, block tables, sequence lengths) as numpy arrays,
flattened without padding: the runner moves it to its device, and with
tensor parallelism rank 0 sends the same object to the other ranks, which
run the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.request import TokenCounts
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, SchedulerOutput


@dataclass
class StepBatch:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, padded with 0
    num_decode_seqs: int

    def to_device(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        qsl_cpu = torch.from_numpy(self.query_start_loc)
        lens_cpu = torch.from_numpy(self.seq_lens)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(self.slot_mapping).to(device),
            query_start_loc=qsl_cpu.to(device),
            seq_lens=lens_cpu.to(device),
            block_tables=torch.from_numpy(self.block_tables).to(device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=lens_cpu,
            num_decode_seqs=self.num_decode_seqs,
            max_query_len=int(np.diff(self.query_start_loc).max()),
            max_seq_len=int(self.seq_lens.max()),
        )
        return (torch.from_numpy(self.input_ids).to(device),
                torch.from_numpy(self.positions).to(device), meta)


@dataclass(eq=False)
class CachedRequestState(TokenCounts):
    """The runner's own copy of a request. Its tokens grow by what the runner
    samples; everything else arrives once, in NewRequestData. Also what the
    sampler reads (``params``, ``token_ids``, ``output_token_ids``...)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    index: int
    row: int  # its row of InputBatch.block_table
    num_blocks: int
    num_prompt_logprobs: int  # prompt positions with a logprob entry (the first is None)
    generator: Any = None  # torch.Generator of a seeded request, made when first sampled
    bad_word_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized
    # The sampler's (key, tensor) of what logit_bias and allowed_token_ids add to its logits.
    logit_offsets: Any = None


@dataclass
class SamplingRows:
    """Where rank 0 finds the rows it samples from and scores prompts with."""

    sampled: list[tuple[CachedRequestState, int]]  # (request, row of its last new token)
    prompt_rows: list[tuple[CachedRequestState, int, int, int]]  # (request, start, row lo, hi)
    # Speculative decoding: (request, its first row, draft tokens); the
    # request's 1 + len(draft) rows from there are verified, not sampled.
    spec: list[tuple[CachedRequestState, int, list[int]]] = field(default_factory=list)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        # [rows, max_blocks] int32: row r is the block table of the request in it.
        self.block_table = np.zeros((max_num_reqs, self.max_blocks), dtype=np.int32)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def update(self, out: SchedulerOutput) -> None:
        """Apply a step's deltas: drop what is gone, add what is new, extend tables."""
        for request_id in out.finished_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self._free_rows.append(state.row)
        for new in out.new_requests:
            self._add(new)
        for s in out.scheduled:
            if s.new_block_ids:
                state = self.requests[s.request_id]
                n = len(s.new_block_ids)
                state.num_blocks = s.num_blocks_before  # less, if rejected drafts freed some
                self.block_table[state.row, state.num_blocks : state.num_blocks + n] = \
                    s.new_block_ids
                state.num_blocks += n

    def _add(self, new: NewRequestData) -> None:
        if new.request_id in self.requests:  # the scheduler sends each once until it is gone
            raise RuntimeError(f"the runner already holds {new.request_id!r}")
        if not self._free_rows:  # more requests than max_num_seqs (n > 1 forks): grow
            old = len(self.block_table)
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        table = self.block_table[row]
        table[:] = 0
        table[: len(new.block_ids)] = new.block_ids
        self.requests[new.request_id] = CachedRequestState(
            new.request_id, new.token_ids, new.num_prompt_tokens, new.params,
            new.eos_token_ids, new.index, row, len(new.block_ids), new.num_prompt_logprobs,
            bad_word_ids=new.bad_word_ids,
        )

    def prepare(self, out: SchedulerOutput) -> tuple[StepBatch, SamplingRows]:
        """This step's flattened inputs, read from the persistent rows."""
        bs = self.block_size
        num_seqs = len(out.scheduled)
        num_tokens = out.num_batched_tokens
        ids = np.empty(num_tokens, dtype=np.int64)
        pos = np.empty(num_tokens, dtype=np.int64)
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        seq_lens = np.empty(num_seqs, dtype=np.int32)
        rows_of = np.empty(num_seqs, dtype=np.int64)
        sampling = SamplingRows([], [])
        t = 0
        for i, s in enumerate(out.scheduled):
            state = self.requests[s.request_id]
            start, n = s.start, s.num_new_tokens
            rows_of[i] = state.row
            if n == 1:  # the decode fast path: plain integers, no array temporaries
                ids[t] = state.token_ids[start]
                pos[t] = start
            else:
                # A speculating decode: its last token, then the proposal.
                ids[t : t + n] = state.token_ids[start : start + n] + s.draft_token_ids \
                    if s.draft_token_ids else state.token_ids[start : start + n]
                pos[t : t + n] = np.arange(start, start + n)
            # NOTE: only the first of n completions: the others start past the
            # prompt blocks they share with it, so they lack the early rows.
            # max(.., 1): a one-token prompt still gets its [None].
            if (state.params.prompt_logprobs is not None and state.index == 0
                    and start < max(state.num_prompt_tokens - 1, 1)):
                sampling.prompt_rows.append((state, start, t, t + n))
            t += n
            query_start[i + 1] = t
            seq_lens[i] = start + n
            if s.draft_token_ids:
                sampling.spec.append((state, t - n, s.draft_token_ids))
            elif s.sample:
                sampling.sampled.append((state, t - 1))
        max_blocks = -(-int(seq_lens.max()) // bs)
        tables = self.block_table[rows_of, :max_blocks]  # [num_seqs, max_blocks], a copy
        # Each token's slot: its sequence's block for its position, and the offset in it.
        seq_of_token = np.repeat(np.arange(num_seqs), np.diff(query_start))
        slots = tables[seq_of_token, pos // bs].astype(np.int64) * bs + pos % bs
        batch = StepBatch(ids, pos, slots, query_start, seq_lens, tables, out.num_decodes)
        return batch, sampling
