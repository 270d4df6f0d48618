"""One step's batch, flattened without padding, on the host.

``StepBatch`` holds exactly what the model's forward pass needs (token ids,
positions, slot mapping, block tables, sequence lengths) as numpy arrays:
the runner moves it to its device, and with tensor parallelism rank 0 sends
the same object to the other ranks, which run the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.request import Request
from engine.scheduler_output import SchedulerOutput


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


@dataclass
class SamplingRows:
    """Where rank 0 finds the rows it samples from and scores prompts with."""

    logits_index: dict[str, int]  # request id -> row of its last new token
    prompt_rows: list[tuple[Request, int, int, int]]  # (request, start, first row, end row)


def flatten(out: SchedulerOutput, block_size: int) -> tuple[StepBatch, SamplingRows]:
    bs = block_size
    num_seqs = len(out.scheduled)
    num_tokens = out.num_batched_tokens
    ids = np.empty(num_tokens, dtype=np.int64)
    pos = np.empty(num_tokens, dtype=np.int64)
    slots = np.empty(num_tokens, dtype=np.int64)
    query_start = np.zeros(num_seqs + 1, dtype=np.int32)
    seq_lens = np.empty(num_seqs, dtype=np.int32)
    max_blocks = max(len(s.request.block_ids) for s in out.scheduled)
    tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    rows = SamplingRows({}, [])
    t = 0
    for i, s in enumerate(out.scheduled):
        request, start, n = s.request, s.start, s.num_new_tokens
        blocks = request.block_ids
        tables[i, : len(blocks)] = blocks
        if n == 1:  # the decode fast path: plain integers, no array temporaries
            ids[t] = request.token_ids[start]
            pos[t] = start
            slots[t] = blocks[start // bs] * bs + start % bs
        else:
            p = np.arange(start, start + n)
            ids[t : t + n] = request.token_ids[start : start + n]
            pos[t : t + n] = p
            slots[t : t + n] = tables[i, p // bs].astype(np.int64) * bs + p % bs
        # NOTE: only the first of n completions: the others start past the
        # prompt blocks they share with it, so they lack the early rows.
        # max(.., 1): a one-token prompt still gets its [None].
        if (request.params.prompt_logprobs is not None and request.index == 0
                and start < max(request.num_prompt_tokens - 1, 1)):
            rows.prompt_rows.append((request, start, t, t + n))
        t += n
        query_start[i + 1] = t
        seq_lens[i] = start + n
        if s.sample:
            rows.logits_index[request.request_id] = t - 1
    batch = StepBatch(ids, pos, slots, query_start, seq_lens, tables, out.num_decodes)
    return batch, rows
