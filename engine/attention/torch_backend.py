"""Attention with torch ops on any device, and a C kernel for CPU tensors.

On the CPU, when the kernel in cpu_attention.py builds here, decodes and
short prefill chunks are served by it in one call, reading the paged cache in
place, and longer prefill chunks by a flash-attention tile kernel (also in
place): amx_prefill.py's in bfloat16 where the CPU has AMX or AVX512-BF16,
f32_prefill.py's in float32 where it has AVX-512; else by SDPA over their
gathered blocks in the cache's dtype. Otherwise, and on other devices,
everything by kernels.reference.
An 8-bit (fp8) cache is always served by kernels.reference, which widens the
gathered blocks to float32 (the C kernel reads only caches in the query's dtype).
"""

from __future__ import annotations

import torch

from engine.attention import amx_prefill, cpu_attention, f32_prefill
from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels import reference

# NOTE: from this many new tokens a sequence's attention is faster as SDPA
# over its gathered blocks (matrix multiplies) than in the C kernel; below
# it, gathering and a call per sequence cost more than they save. float32,
# SmolLM2's heads, a layer on a 2-core AMD EPYC: 64 x 64 tokens 12.9 ms in
# the C kernel against 31.7 in SDPA, 32 x 128 16.1 against 25.7, 16 x 256
# 28.8 against 29.6, 8 x 500 49.9 against 48.0, 1 x 2000 94 against 51.
SDPA_FROM = 256
# NOTE: from this many new tokens a sequence's attention goes to a tile
# kernel (one tile of 16 query tokens): amx_prefill's in bfloat16,
# f32_prefill's in float32. With AMX the first is faster than the C kernel
# from 2 new tokens (0.63 against 0.82 ms for 2 after 256 cached, 16
# sequences, one thread), but it rounds the softmax weights to bfloat16, and
# both sum in another order than the C kernel: below a tile, speculative
# verification (k + 1 tokens) stays on the C kernel, whose rows compute
# exactly as the decodes they stand for, so a greedy text is the same with
# and without speculation. In float32 the tile kernel is 2.6-2.9x the C
# kernel's speed from 16 tokens (16 x 16 to 4 x 256 after 256 cached, a
# layer on a 2-core AMD EPYC).
TILE_FROM = 16


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
            if amx_prefill.supports(query, k_cache):
                prefill, long_from = amx_prefill.prefill, TILE_FROM
            elif f32_prefill.supports(query, k_cache):
                prefill, long_from = f32_prefill.prefill, TILE_FROM
            else:
                prefill, long_from = cpu_attention.prefill_sdpa, SDPA_FROM
            out = cpu_attention.paged_attention(*args, max_query_len=long_from - 1)
            if meta.max_query_len >= long_from:
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
