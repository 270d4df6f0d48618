"""The attention backend contract the model layers call."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where every token of one flattened batch reads and writes the paged cache.

    Sequences are ordered decodes first: the first ``num_decode_seqs``
    sequences have exactly one new token each (and so occupy the first
    ``num_decode_seqs`` rows of the batch); the rest are prefills or extends
    with one or more new tokens. Built once per step by the runner and shared
    by every layer.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_seqs] int32, cached + new tokens, on the device
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc_cpu: torch.Tensor  # the same on the host, for launch decisions
    seq_lens_cpu: torch.Tensor
    num_decode_seqs: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionBackend(ABC):
    """Stores a batch's new keys/values in the paged cache, then attends.

    Invariants: ``forward`` writes ``key``/``value`` to the slots in
    ``meta.slot_mapping`` before reading the cache, so a token attends to
    itself and to earlier tokens of the same step; it reads no slot outside a
    sequence's first ``seq_lens[i]`` positions of its block table.
    """

    name: str
    # True when ``forward`` launches from ``num_seqs``, ``num_decode_seqs``,
    # ``max_query_len`` and ``max_seq_len`` alone: it never reads the *_cpu
    # tensors, syncs the device or allocates by data, so a decode step can be
    # recorded once in a CUDA graph and replayed with new inputs.
    graph_safe: bool = False
    # True when Triton runs where this backend does: the model's RMSNorm and
    # rotary layers then use the fused kernels in kernels/ as well.
    fused_layers: bool = False
    # Per-tensor scales of an 8-bit KV cache (engine/kv_quant.py): stored
    # values are ``x / scale``. Unused for a cache in the model's dtype.
    k_scale: float = 1.0
    v_scale: float = 1.0

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
