"""Torch reference for every kernel: the one definition of the maths.

The engine's CPU backend calls these functions directly; the Triton
kernels are tested against them.

Cache layout (per layer, one tensor for keys and one for values)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A token's *slot* is ``block_id * block_size + offset_in_block``. A request's
block table lists its block ids in token order, so token ``i`` of a request
lives in block ``block_table[i // block_size]`` at offset ``i % block_size``.

Batches are flattened without padding: the new tokens of all sequences are
concatenated, and ``query_start_loc`` (``[num_seqs + 1]``, cumulative) says
where each sequence's tokens begin. ``seq_lens`` counts every token a sequence
attends to, cached ones included; its new tokens are its *last*
``query_len`` positions, so the causal mask for query ``j`` of a sequence is
``key_pos <= seq_len - query_len + j``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: for an 8-bit float cache
    ``clamp(x / scale)`` to the type's finite range (never NaN), else a cast."""
    if dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cached keys or values in float32: ``x * scale`` for an 8-bit cache."""
    if x.dtype == torch.float8_e4m3fn and x.device.type == "cpu":
        # NOTE: torch widens e4m3 on the CPU one element at a time. Its sign,
        # exponent and mantissa bits placed in a float16 read as the value
        # times 2**-8 (normal and subnormal alike, the exponent biases differ
        # by 8), which is exact for every finite e4m3 and twice as fast.
        u = x.view(torch.uint8).to(torch.int16)
        half = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).view(torch.float16)
        return half.float() * (256.0 * scale)
    out = x.float()
    return out * scale if x.dtype in FP8_KV_DTYPES and scale != 1.0 else out


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = do not store
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's key and value into its cache slot (``quantize_kv``
    with the scales for an 8-bit cache)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    k_new = quantize_kv(key, k_cache.dtype, k_scale)
    v_new = quantize_kv(value, v_cache.dtype, v_scale)
    if k_cache.dtype in FP8_KV_DTYPES:  # index_copy_ has no fp8 kernel on the CPU: copy bytes
        flat_k, flat_v = flat_k.view(torch.uint8), flat_v.view(torch.uint8)
        k_new, v_new = k_new.view(torch.uint8), v_new.view(torch.uint8)
    flat_k.index_copy_(0, slot_mapping.long(), k_new)
    flat_v.index_copy_(0, slot_mapping.long(), v_new)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_blocks_of_seq] int
    seq_len: int,
) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of one sequence: [seq_len, kv_heads, dim]."""
    num_blocks = (seq_len + cache.shape[1] - 1) // cache.shape[1]
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:seq_len]


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    seq_lens: torch.Tensor,  # [num_seqs] int
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One new query token per sequence against its whole cached context.

    All sequences are gathered into one padded batch and computed with a
    single masked attention, so the cost per step does not grow with a Python
    loop over sequences.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :max_blocks].long()
    # [num_seqs, kv_heads, max_len, dim]
    # (widened while contiguous: elementwise ops on the transposed view are slow)
    keys = dequantize_kv(k_cache[table], k_scale).flatten(1, 2)[:, :max_len].transpose(1, 2)
    values = dequantize_kv(v_cache[table], v_scale).flatten(1, 2)[:, :max_len].transpose(1, 2)
    positions = torch.arange(max_len, device=query.device)
    valid = positions[None, :] < seq_lens[:, None]  # [num_seqs, max_len]
    # NOTE: SDPA rather than matmul + softmax: on the CPU it reads the strided
    # keys in place, where matmul first copied them transposed (2x faster for
    # SmolLM2 decode batches). enable_gqa maps query heads to kv heads.
    out = F.scaled_dot_product_attention(
        query[:, :, None, :].float(), keys, values, attn_mask=valid[:, None, None, :],
        scale=scale, enable_gqa=True,
    )  # [num_seqs, num_heads, 1, dim]
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int, on the host
    seq_lens: torch.Tensor,  # [num_seqs] int, on the host
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens against its cached
    blocks and themselves (chunked prefill, prefix-cache hits, extends).

    The new tokens' keys and values must already be in the cache.
    """
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        keys = gather_kv(k_cache, block_tables[i], seq_len)
        values = gather_kv(v_cache, block_tables[i], seq_len)
        # [heads, q_len, dim], with kv heads repeated for grouped-query attention
        q = query[start:end].transpose(0, 1).float()
        group = num_heads // num_kv_heads
        k = dequantize_kv(keys, k_scale).transpose(0, 1).repeat_interleave(group, 0)
        v = dequantize_kv(values, v_scale).transpose(0, 1).repeat_interleave(group, 0)
        # Query j sits at absolute position seq_len - q_len + j.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1).to(query.dtype)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return norm(residual) * weight, residual``.

    Computed in float32 like Hugging Face's Llama; returns the input dtype.
    """
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)), residual


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim // 2]
    sin: torch.Tensor,
) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2): the "rotate half" layout of HF Llama."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def unpack_int_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C]`` int32 words -> ``[R * 32 / bits, C]`` integers in [0, 2**bits):
    row ``r * 32 / bits + i`` is bits ``[i * bits, (i + 1) * bits)`` of word row ``r``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    vals = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return vals.reshape(-1, packed.shape[1])


def dequantize(
    qweight: torch.Tensor,  # [in / (32 / bits), out] int32, packed along the input
    scales: torch.Tensor,  # [groups, out]
    zeros: torch.Tensor,  # [groups, out], zero points (integers held in a float dtype)
    g_idx: torch.Tensor,  # [in] int, the group of each input row
    bits: int,
) -> torch.Tensor:  # [in, out] in scales.dtype
    """``W[k, n] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]``, in float32."""
    q = unpack_int_rows(qweight, bits).float()
    g = g_idx.long()
    return ((q - zeros.float()[g]) * scales.float()[g]).to(scales.dtype)


def quant_matmul(
    x: torch.Tensor,  # [num_tokens, in]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
) -> torch.Tensor:  # [num_tokens, out] in x.dtype
    """``x @ W`` with the weight of ``dequantize``, rounded to ``x.dtype``."""
    return x @ dequantize(qweight, scales, zeros, g_idx, bits).to(x.dtype)


def scaled_matmul(
    x: torch.Tensor,  # [num_tokens, in]
    weight: torch.Tensor,  # [out, in] int8 or float8_e4m3fn
    scale: torch.Tensor,  # [out] (one per output row) or [1] (one for all), float
) -> torch.Tensor:  # [num_tokens, out] in x.dtype
    """``x @ (weight * scale[:, None]).T`` in float32, rounded to ``x.dtype``:
    compressed-tensors' 8-bit weights (W8A16)."""
    w = weight.float() * scale.float().reshape(-1, 1)
    return (x.float() @ w.T).to(x.dtype)
