"""``x @ W`` with ``W`` held as packed 4- or 8-bit integers (GPTQ/AWQ).

Decoding reads every weight once per step, so a 4-bit weight moves a quarter
of the bytes of a 16-bit one. The kernel never writes ``W`` out: each program
owns a ``[BLOCK_M, BLOCK_N]`` tile of the output and, per ``BLOCK_K`` slice
of the input dimension, loads the packed words, shifts each row's integer
out, dequantizes it with its group's scale and zero point (``g_idx`` names
the group, so act-order checkpoints need nothing special) and feeds
``tl.dot``. Same semantics as ``reference.quant_matmul``.
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
    LOWP_DOT: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        words = tl.load(qweight_ptr + (ks // PACK)[:, None] * stride_qk + cols[None, :],
                        mask=w_mask, other=0)
        q = (words >> ((ks % PACK) * BITS)[:, None]) & MASK  # [BLOCK_K, BLOCK_N]
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
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:  # [num_tokens, out] in x.dtype
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
        LOWP_DOT=lowp_dot(x.dtype, device),
        num_warps=4,
    )
    return out
