"""Attention with torch ops on any device, and a C kernel for CPU tensors.

On the CPU, when the kernel in cpu_attention.py builds here, decodes and
short prefill chunks are served by it in one call, reading the paged cache in
place, and longer prefill chunks in bfloat16 by the tile kernel of
amx_prefill.py (also in place) where the CPU has AMX or AVX512-BF16, else by
SDPA over their gathered blocks in the cache's dtype (float32 always: it
matches Hugging Face's); otherwise, and on other devices, everything by
kernels.reference.
An 8-bit (fp8) cache is always served by kernels.reference, which widens the
gathered blocks to float32 (the C kernel reads only caches in the query's dtype).
"""

from __future__ import annotations

import torch

from engine.attention import amx_prefill, cpu_attention
from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels import reference

# NOTE: from this many new tokens a sequence's attention is faster as SDPA
# over its gathered blocks (matrix multiplies) than in the C kernel; below
# it, gathering and a call per sequence cost more than they save. float32,
# SmolLM2's heads, a layer on a 2-core AMD EPYC: 64 x 64 tokens 12.9 ms in
# the C kernel against 31.7 in SDPA, 32 x 128 16.1 against 25.7, 16 x 256
# 28.8 against 29.6, 8 x 500 49.9 against 48.0, 1 x 2000 94 against 51.
SDPA_FROM = 256
# NOTE: from this many new tokens a bfloat16 sequence's attention goes to
# amx_prefill's kernel (one tile of 16 query tokens). With AMX it is faster
# than the C kernel from 2 new tokens (0.63 against 0.82 ms for 2 after 256
# cached, 16 sequences, one thread), but it rounds the softmax weights to
# bfloat16: below a tile, speculative verification (k + 1 tokens) stays on
# the C kernel, whose rows compute exactly as the decodes they stand for, so
# a greedy bfloat16 text is the same with and without speculation.
AMX_FROM = 16


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, native: bool = True) -> None:
        """``native=False`` keeps to kernels.reference everywhere."""
        self.native = native

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale):
        if self.native and cpu_attention.supports(query, k_cache) and k_cache.is_contiguous():
            cpu_attention.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
            args = (query, k_cache, v_cache, meta.block_tables, meta.query_start_loc_cpu,
                    meta.seq_lens_cpu, scale)
            amx = amx_prefill.supports(query, k_cache)
            long_from = AMX_FROM if amx else SDPA_FROM
            out = cpu_attention.paged_attention(*args, max_query_len=long_from - 1)
            if meta.max_query_len >= long_from:
                prefill = amx_prefill.prefill if amx else cpu_attention.prefill_sdpa
                prefill(*args, out=out, min_query_len=long_from)
            return out
        kv_scales = (self.k_scale, self.v_scale)
        reference.store_kv(key, value, k_cache, v_cache, meta.slot_mapping, *kv_scales)
        nd = meta.num_decode_seqs
        if nd == meta.num_seqs:
            return reference.paged_decode_attention(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, *kv_scales
            )
        out = torch.empty_like(query)
        if nd:
            out[:nd] = reference.paged_decode_attention(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                *kv_scales,
            )
        starts = meta.query_start_loc_cpu[nd:] - nd
        out[nd:] = reference.paged_prefill_attention(
            query[nd:], k_cache, v_cache, meta.block_tables[nd:], starts,
            meta.seq_lens_cpu[nd:], scale, *kv_scales,
        )
        return out
