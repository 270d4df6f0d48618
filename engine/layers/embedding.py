"""Token embeddings split by vocabulary rows across tensor-parallel ranks.

Rank r holds rows ``[r * V / size, (r + 1) * V / size)`` of the table. Each
rank looks up the ids that fall in its rows, zeros the others, and an
all-reduce sums the ranks' lookups: every id is found on exactly one rank.
The LM head reuses the same split (a tied head shares this very weight):
each rank scores its own vocabulary slice and rank 0 gathers the slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.packed import PackedWeight
from engine.parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.rows = tp.split(vocab_size, "vocab_size")
        self.first = tp.rank * self.rows
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
        self.weight.tp_dim = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0.0))


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TensorParallel,
                 packed: PackedWeight | None = None) -> torch.Tensor | None:
    """Logits ``[num_rows, vocab]`` on rank 0 (None on the others) from each
    rank's vocabulary slice of the head's ``weight`` (multiplied through
    ``packed``, the weight's packed copy, when given): in the model's dtype
    on one rank (consumers widen them to float32 where they need to), in
    float32 when gathered from several."""
    local = F.linear(hidden, weight) if packed is None else packed.linear(hidden, weight)
    if tp.size == 1:
        return local
    local = local.float()
    parts = tp.gather(local)
    return None if parts is None else torch.cat(parts, dim=1)
