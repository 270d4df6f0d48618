"""Attention with plain torch ops: the CPU backend, built on kernels.reference."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels import reference


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale):
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
