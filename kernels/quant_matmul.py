"""``x @ W`` with ``W`` held as packed 4- or 8-bit integers (GPTQ/AWQ).

Decoding reads every weight once per step, so a 4-bit weight moves a quarter
of the bytes of a 16-bit one. The kernel never writes ``W`` out: each program
owns a ``[BLOCK_M, BLOCK_N]`` tile of the output and, per ``BLOCK_K`` slice
of the input dimension, loads the slice's packed words once, shifts each
row's integer out of them, dequantizes it with its group's scale and zero
point (``g_idx`` names the group, so act-order checkpoints need nothing
special) and feeds ``tl.dot``. When every aligned ``BLOCK_K`` slice lies in
one group (``uniform_rows``: the checkpoint's rows are in order), the
slice's scales and zero points are one row each, loaded once rather than per
input row. Same semantics as ``reference.quant_matmul``.

Launches measured on an H200 at Llama-3-8B's gate/up (4096 -> 28672, groups
of 128; benchmarks/quant_tiles_gpu.py, docs/benchmarks.md): at 1-16 tokens
(block_n 64, block_k 128) reads the weights at about 800 GB/s, 2.6x the
kernel that loaded scales and packed words per input row; from 64 tokens
on (128, 64) is best.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_last_dim_contiguous,
    check_tensor,
    lowp_dot,
)


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_g,  # scales and zeros share their layout
    stride_om,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNIFORM_GROUPS: tl.constexpr,
    LOWP_DOT: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WORDS: tl.constexpr = BLOCK_K // PACK
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    shifts = tl.arange(0, PACK) * BITS
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K  # K is a multiple of PACK: a word is wholly in or out
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        word_rows = k0 // PACK + tl.arange(0, WORDS)
        words = tl.load(qweight_ptr + word_rows[:, None] * stride_qk + cols[None, :],
                        mask=(word_rows < K // PACK)[:, None] & col_ok[None, :], other=0)
        # Input row k0 + PACK * r + j is bits [j * BITS, (j + 1) * BITS) of word row r.
        q = (words[:, None, :] >> shifts[None, :, None]) & MASK  # [WORDS, PACK, BLOCK_N]
        q = tl.reshape(q, [BLOCK_K, BLOCK_N])
        if UNIFORM_GROUPS:  # the whole slice is one group: one row of scales and zeros
            g_off = tl.load(g_idx_ptr + k0) * stride_g + cols
            scale = tl.load(scales_ptr + g_off, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            zero = tl.load(zeros_ptr + g_off, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        else:
            w_mask = k_ok[:, None] & col_ok[None, :]
            group = tl.load(g_idx_ptr + ks, mask=k_ok, other=0)
            g_off = group[:, None] * stride_g + cols[None, :]
            scale = tl.load(scales_ptr + g_off, mask=w_mask, other=0.0).to(tl.float32)
            zero = tl.load(zeros_ptr + g_off, mask=w_mask, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - zero) * scale
        if LOWP_DOT:
            acc = tl.dot(x, w.to(x.dtype), acc)
        else:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def quant_matmul(
    x: torch.Tensor,  # [num_tokens, in]
    qweight: torch.Tensor,  # [in / (32 / bits), out] int32
    scales: torch.Tensor,  # [groups, out]
    zeros: torch.Tensor,  # [groups, out]
    g_idx: torch.Tensor,  # [in] int
    bits: int,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    uniform_rows: int = 0,
    num_warps: int = 4,
) -> torch.Tensor:  # [num_tokens, out] in x.dtype
    """``uniform_rows``: the caller vouches that ``g_idx`` is constant over
    every aligned run of this many rows (``uniform_group_rows`` finds it; 0:
    not known), so that a slice of at most that many rows loads its scales
    and zero points once. ``block_*`` and ``num_warps``: for tuning and tests."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = x.device
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), device=device)
    check_tensor("scales", scales, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("zeros", zeros, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("g_idx", g_idx, ndim=1, dtypes=INDEX_DTYPES, device=device)
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != k:
        raise ValueError(
            f"qweight has {qweight.shape[0]} packed rows ({32 // bits} per word) but x has {k} "
            f"input features"
        )
    if scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(
            f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must both be "
            f"[groups, {n}]"
        )
    if g_idx.shape[0] != k:
        raise ValueError(f"g_idx has {g_idx.shape[0]} entries, expected {k}")
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros),
                    ("g_idx", g_idx)):
        check_last_dim_contiguous(name, t)
    if scales.stride() != zeros.stride():
        raise ValueError("scales and zeros must share their strides")
    default_n, default_k = _default_tiles(m, uniform_rows)
    block_n = default_n if block_n is None else block_n
    block_k = default_k if block_k is None else block_k
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if block_m is None:  # decode batches are short: do not pad them to 64 rows
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    out = torch.empty(m, n, dtype=x.dtype, device=device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](
        x, qweight, scales, zeros, g_idx, out,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UNIFORM_GROUPS=uniform_rows >= block_k and uniform_rows % block_k == 0,
        LOWP_DOT=lowp_dot(x.dtype, device),
        num_warps=num_warps,
    )
    return out


def _default_tiles(m: int, uniform_rows: int) -> tuple[int, int]:
    """(block_n, block_k) for ``m`` tokens (see the module's docstring)."""
    if uniform_rows < 16:  # act order: the per-row launch
        return 64, 64
    block_n, block_k = (64, 128) if m <= 16 else (128, 64)
    return block_n, min(block_k, uniform_rows)  # one group per slice


def uniform_group_rows(g_idx: torch.Tensor, most: int = 128) -> int:
    """The longest aligned run of rows, a power of two from 16 to ``most``,
    over which ``g_idx`` is constant everywhere (rows in checkpoint order
    give their group size, or ``most``), else 0 (act order, small groups).
    Reads ``g_idx`` back from the device: call once per layer, not per step."""
    k, run = g_idx.shape[0], most
    while run >= 16:
        if k % run == 0:
            chunks = g_idx.reshape(k // run, run)
            if bool((chunks == chunks[:, :1]).all()):
                return run
        run //= 2
    return 0
