"""Attention with torch ops on any device, and a C kernel for CPU tensors.

On the CPU, when the kernel in cpu_attention.py builds here, every sequence
(decodes and prefills in one call) is served by it, reading the paged cache
in place; otherwise, and on other devices, by kernels.reference.
"""

from __future__ import annotations

import torch

from engine.attention import cpu_attention
from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels import reference


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, native: bool = True) -> None:
        """``native=False`` keeps to kernels.reference everywhere."""
        self.native = native

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale):
        if self.native and cpu_attention.supports(query, k_cache) and k_cache.is_contiguous():
            cpu_attention.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
            return cpu_attention.paged_attention(
                query, k_cache, v_cache, meta.block_tables, meta.query_start_loc_cpu,
                meta.seq_lens_cpu, scale,
            )
        reference.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode_seqs
        if nd == meta.num_seqs:
            return reference.paged_decode_attention(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale
            )
        out = torch.empty_like(query)
        if nd:
            out[:nd] = reference.paged_decode_attention(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
            )
        starts = meta.query_start_loc_cpu[nd:] - nd
        out[nd:] = reference.paged_prefill_attention(
            query[nd:], k_cache, v_cache, meta.block_tables[nd:], starts,
            meta.seq_lens_cpu[nd:], scale,
        )
        return out
