"""Attention with the Triton kernels: the GPU backend.

Mirrors torch_backend.py: store the step's keys and values, then run the
decode kernel over the first ``num_decode_seqs`` rows and the prefill kernel
over the rest. Both kernels write straight into one output buffer and read
launch sizes from the host-side metadata, so a step never syncs the device.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.store_kv import store_kv


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    graph_safe = True
    fused_layers = True

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale):
        kv_scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}  # used by an fp8 cache
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping, **kv_scales)
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        nd = meta.num_decode_seqs
        if nd:
            paged_decode_attention(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                max_seq_len=meta.max_seq_len, out=out[:nd], **kv_scales,
            )
        if nd < meta.num_seqs:
            # query_start_loc[nd:] still indexes rows of the whole batch, so the
            # prefill kernel reads `query` and writes `out` without slicing.
            paged_prefill_attention(
                query, k_cache, v_cache, meta.block_tables[nd:], meta.query_start_loc[nd:],
                meta.seq_lens[nd:], scale, meta.max_query_len, out=out, **kv_scales,
            )
        return out
