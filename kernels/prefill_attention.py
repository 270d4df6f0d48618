"""Paged prefill / extend attention over a flattened varlen batch.

Each sequence's new tokens attend causally to its cached blocks and to
themselves (their keys and values are already stored). A program owns one
tile of a sequence's new tokens for one kv head; the tile's rows are
(token, query head of the group) pairs, so grouped-query attention reads each
K/V tile once for the whole group::

    row m  ->  token  q_block * BLOCK_Q + m // GROUP_PAD,  head  kv_head * GROUP + m % GROUP_PAD

With ``ctx_len = seq_len - query_len`` cached tokens, new token j sits at
position ``ctx_len + j``. Keys before the tile's first position are visible
to every row and need no mask; only the last stretch, up to the tile's last
position, is masked causally::

    keys: [0 ........ unmasked ........ | masked | )
          0                     first_pos      last_pos + 1

Same semantics as ``reference.paged_prefill_attention``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._checks import (
    INDEX_DTYPES,
    check_cache_pair,
    check_last_dim_contiguous,
    check_out,
    check_tensor,
    check_tile,
    lowp_dot,
    next_power_of_2,
    query_dtypes,
)


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    head_off,
    tile_start,
    key_end,
    q_pos,
    dims,
    dim_ok,
    qk_scale,
    stride_cache_block,
    stride_cache_slot,
    k_scale,
    v_scale,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOWP_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One online-softmax step over keys [tile_start, tile_start + BLOCK_N)."""
    pos = tile_start + tl.arange(0, BLOCK_N)
    pos_ok = pos < key_end
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    kv_off = (
        block[:, None] * stride_cache_block
        + (pos % BLOCK_SIZE)[:, None] * stride_cache_slot
        + head_off
        + dims[None, :]
    )
    kv_mask = pos_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, DIM_PAD]
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    if KV_FP8:  # widen to the query's dtype: the rest reads as for a float cache
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    if LOWP_DOT:
        qk = tl.dot(q, tl.trans(k))
    else:
        qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    qk = qk * qk_scale
    if CAUSAL:
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    # Key 0 is visible to every row and is in the first tile, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if LOWP_DOT:
        acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    k_scale,  # an fp8 cache holds x / scale
    v_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOWP_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    # Tiles with the most keys first: they finish last otherwise.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP_PAD
    g = rows % GROUP_PAD
    heads = kv_head * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    io_mask = row_ok[:, None] & dim_ok[None, :]

    q_off = (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q_ptrs = q_ptr + q_off
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    if not LOWP_DOT:
        q = q.to(tl.float32)
    q_pos = ctx_len + tok  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt
    head_off = kv_head * stride_cache_head

    first_pos = ctx_len + q_block * BLOCK_Q
    key_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # one past the tile's last position
    unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
    for tile_start in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_ptr, head_off, tile_start,
            key_end, q_pos, dims, dim_ok, qk_scale, stride_cache_block, stride_cache_slot,
            k_scale, v_scale, BLOCK_SIZE, BLOCK_N, False, LOWP_DOT, KV_FP8,
        )
    for tile_start in range(unmasked_end, key_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_ptr, head_off, tile_start,
            key_end, q_pos, dims, dim_ok, qk_scale, stride_cache_block, stride_cache_slot,
            k_scale, v_scale, BLOCK_SIZE, BLOCK_N, True, LOWP_DOT, KV_FP8,
        )

    o = acc / l_i[:, None]
    o_off = (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    o_ptrs = out_ptr + o_off
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


def _default_tiles(head_dim: int) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps) for the GPU.

    Head dim 128: the best of 36 launches over kernels_gpu.py's prefill cases
    on an H200 (benchmarks/prefill_tiles_gpu.py; docs/benchmarks.md), 1.15x
    the earlier (128, 64, 8) by geometric mean.
    """
    if head_dim <= 64:
        return 128, 64, 4
    if head_dim <= 128:
        return 128, 32, 4
    return 64, 32, 8


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int, on the device
    seq_lens: torch.Tensor,  # [num_seqs] int, on the device
    scale: float,
    max_query_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its cache.

    ``query_start_loc`` indexes rows of ``query`` and need not start at 0, so
    a caller can pass a whole batch's query and ``out`` with the start
    offsets of a subset of its sequences; rows of ``out`` that belong to no
    sequence are left untouched. ``max_query_len`` bounds the new tokens per
    sequence (it sizes the grid); without it, it is read back from the
    device. ``block_m`` (rows = tokens x group heads) and ``block_n`` (keys)
    are tile sizes, ``num_warps`` and ``num_stages`` the launch's, for tuning
    (benchmarks/prefill_tiles_gpu.py) and tests. ``k_scale``/``v_scale``: the scales
    of an fp8 cache (ignored otherwise).
    """
    _, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    device = k_cache.device
    check_tensor("query", query, ndim=3, dtypes=query_dtypes(k_cache.dtype), device=device)
    num_heads, q_dim = query.shape[1], query.shape[2]
    if q_dim != head_dim:
        raise ValueError(f"query head_dim {q_dim} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_last_dim_contiguous("query", query)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_last_dim_contiguous("block_tables", block_tables)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"seq_lens has {num_seqs} sequences, so block_tables needs {num_seqs} rows "
            f"(has {block_tables.shape[0]}) and query_start_loc {num_seqs + 1} entries "
            f"(has {query_start_loc.shape[0]})"
        )
    if not (seq_lens.is_contiguous() and query_start_loc.is_contiguous()):
        raise ValueError("seq_lens and query_start_loc must be contiguous")
    out = check_out(out, query)

    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    gpu_m, gpu_n, gpu_warps = _default_tiles(head_dim)
    block_m = check_tile("block_m", block_m if block_m is not None else max(gpu_m, group_pad))
    block_n = check_tile("block_n", block_n if block_n is not None else gpu_n)
    if block_m < group_pad:
        raise ValueError(f"block_m {block_m} must hold a whole group of {group} query heads")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    elif not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    if num_seqs == 0 or max_query_len == 0:
        return out

    block_q = block_m // group_pad
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        float(k_scale),
        float(v_scale),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        LOWP_DOT=lowp_dot(query.dtype, device),
        KV_FP8=k_cache.dtype != query.dtype,
        num_warps=num_warps or gpu_warps,
        num_stages=num_stages or 3,
    )
    return out
