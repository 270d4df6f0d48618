"""``x @ W.T`` with ``W`` held in 8 bits (INT8 or FP8 e4m3) and a float32
scale per output row or one for all (compressed-tensors' W8A16).

A decode step reads every weight once, so 8-bit weights move half the bytes
of bfloat16 ones. Each program owns a ``[BLOCK_M, BLOCK_N]`` tile of the
output and, per ``BLOCK_K`` slice of the inputs, loads the 8-bit weight tile
``[BLOCK_K, BLOCK_N]`` straight from the ``[out, in]`` layout ``nn.Linear``
uses, widens it to the input's dtype (both INT8 and e4m3 widen to bfloat16
and float16 exactly) and feeds ``tl.dot``. The scale is constant along the
inputs, so it multiplies the float32 accumulator once, at the end. Same
semantics as ``reference.scaled_matmul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_tensor,
    check_tile,
    lowp_dot,
)

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)


@triton.jit
def _scaled_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    SCALE_PER_ROW: tl.constexpr,  # False: one scale for every row
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOWP_DOT: tl.constexpr,
):
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
        # Column n of the tile is row n of W: W.T without moving it.
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if LOWP_DOT:
            acc = tl.dot(x, w.to(x.dtype), acc)
        else:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    if SCALE_PER_ROW:
        scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
        acc = acc * scale[None, :]
    else:
        acc = acc * tl.load(scale_ptr)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def scaled_matmul(
    x: torch.Tensor,  # [num_tokens, in]
    weight: torch.Tensor,  # [out, in] int8 or float8_e4m3fn
    scale: torch.Tensor,  # [out] or [1] float32
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:  # [num_tokens, out] in x.dtype
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = x.device
    check_tensor("weight", weight, ndim=2, dtypes=WEIGHT_DTYPES, device=device)
    check_tensor("scale", scale, ndim=1, dtypes=(torch.float32,), device=device)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} input features but x has {k}")
    if scale.shape[0] not in (1, n):
        raise ValueError(f"scale has {scale.shape[0]} entries; expected 1 or {n} (one per row)")
    for name, t in (("x", x), ("weight", weight), ("scale", scale)):
        check_last_dim_contiguous(name, t)
    check_tile("block_n", block_n)
    check_tile("block_k", block_k)
    if block_m is None:  # decode batches are short: do not pad them to 64 rows
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    check_tile("block_m", block_m)
    out = torch.empty(m, n, dtype=x.dtype, device=device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scaled_matmul_kernel[grid](
        x, weight, scale, out,
        m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        SCALE_PER_ROW=scale.shape[0] > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        LOWP_DOT=lowp_dot(x.dtype, device),
        num_warps=4,
    )
    return out
