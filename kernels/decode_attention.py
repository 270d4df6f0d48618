"""Paged decode attention: one new query token per sequence.

Decode is bound by reading K and V, so the kernel is built to read each cached
key and value once:

* one program owns one (sequence, kv head, context split) and computes every
  query head of that kv head's group together, so grouped-query attention
  reads the group's K/V once, not once per query head;
* a K/V tile spans ``BLOCK_N`` tokens, several cache blocks: the block table
  is gathered per token, so tiles need no alignment to blocks;
* short batches split the context (split-K) so that there are enough
  programs to fill the GPU; each split writes its normalised partial output
  and log-sum-exp, and a second kernel merges them.

Split ``s`` of a sequence covers tokens [s * per_split, (s + 1) * per_split)
with per_split = ceil(ceil(seq_len / num_splits) / BLOCK_N) * BLOCK_N, so
splits start on tile boundaries; trailing splits of a short sequence are empty
and contribute nothing.

Same semantics as ``reference.paged_decode_attention``; seq_lens must be >= 1.
"""

from __future__ import annotations

import functools
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

_MIN_SPLIT_TOKENS = 256  # do not split the context finer than this
_MAX_SPLITS = 32
_HOST_SMS = 4  # the CPU interpreter "has" 4 SMs, which keeps its grids small


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32, if SPLIT
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32, log2 units, if SPLIT
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    num_splits,
    stride_qs,
    stride_qh,
    stride_os,
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
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    LOWP_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    rows = tl.arange(0, GROUP_PAD)  # query heads of this kv head, padded for tl.dot
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM

    q_ptrs = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if not LOWP_DOT:
        q = q.to(tl.float32)

    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt
    head_off = kv_head * stride_cache_head
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        # Token pos lives in block table[pos // BLOCK_SIZE] at offset pos % BLOCK_SIZE.
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
        if not LOWP_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        if LOWP_DOT:
            qk = tl.dot(q, tl.trans(k))
        else:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        qk = tl.where(pos_ok[None, :], qk * qk_scale, float("-inf"))
        # Online softmax: every tile holds a valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if LOWP_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        m_i = m_new

    if SPLIT:
        empty = l_i == 0.0  # a split past the end of a short sequence
        l_safe = tl.where(empty, 1.0, l_i)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
        part_row = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        o_ptrs = part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :]
        tl.store(o_ptrs, acc / l_safe[:, None], mask=row_ok[:, None] & dim_ok[None, :])
    else:
        o = acc / l_i[:, None]
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(
            o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :]
        )


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    split_ok = splits < num_splits
    row = (seq * tl.num_programs(1) + head) * num_splits + splits

    lse = tl.load(part_lse_ptr + row, mask=split_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # empty splits weigh 0
    o_ptrs = part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :]
    o = tl.load(o_ptrs, mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    merged = tl.sum(weight[:, None] * o, 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _HOST_SMS


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Split the context until there are about two programs per SM, but never
    into pieces shorter than _MIN_SPLIT_TOKENS."""
    wanted = math.ceil(2 * _num_sms(device) / max(1, num_seqs * num_kv_heads))
    by_length = math.ceil(max_seq_len / _MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def _default_block_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    seq_lens: torch.Tensor,  # [num_seqs] int, on the device
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of each sequence's single query token over its cached context.

    ``num_splits`` fixes the number of context splits; by default it follows
    from the batch size and ``max_seq_len`` (an upper bound on ``seq_lens``;
    without it the block-table width is used, so nothing is read back from the
    device). ``out`` may be a view such as rows of a larger batch's output.
    ``block_n`` is the K/V tile length in tokens (tuning and tests).
    ``k_scale``/``v_scale``: the scales of an fp8 cache (ignored otherwise).
    """
    _, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    device = k_cache.device
    check_tensor("query", query, ndim=3, dtypes=query_dtypes(k_cache.dtype), device=device)
    num_seqs, num_heads, q_dim = query.shape
    if q_dim != head_dim:
        raise ValueError(f"query head_dim {q_dim} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_last_dim_contiguous("query", query)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_last_dim_contiguous("block_tables", block_tables)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"query has {num_seqs} sequences but block_tables has {block_tables.shape[0]} "
            f"rows and seq_lens {seq_lens.shape[0]}"
        )
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    out = check_out(out, query)
    block_n = check_tile("block_n", block_n if block_n is not None else _default_block_n(head_dim))
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, bound, device)
    elif not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    dim_pad = max(16, next_power_of_2(head_dim))  # tl.dot needs K >= 16
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device
        )
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=device)
    else:  # unused placeholders
        part_out = part_lse = out
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * math.log2(math.e),
        num_splits,
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
        GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        LOWP_DOT=lowp_dot(query.dtype, device),
        KV_FP8=k_cache.dtype != query.dtype,
        num_warps=4,
        num_stages=3,
    )
    if split:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            SPLITS_PAD=next_power_of_2(num_splits),
            num_warps=1 if dim_pad <= 64 else 2,
        )
    return out
