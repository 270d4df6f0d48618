"""Fused residual add + RMSNorm, one program per token.

Same semantics as ``reference.rms_norm``: ``residual = x + residual`` is
rounded to the input dtype, normalised in float32, rounded again, then
scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_tensor,
    next_power_of_2,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    stride_x,
    stride_r,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(residual_out_ptr.dtype.element_ty)  # rounded, as torch adds
        tl.store(residual_out_ptr + row * HIDDEN + cols, h, mask=mask)
        x = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return norm(residual) * weight, residual``.

    Without ``residual``, ``x`` itself is returned as the residual. The
    output has the promoted dtype of ``weight`` and ``x``, like the reference.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    num_tokens, hidden = x.shape
    if weight.shape[0] != hidden or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{hidden}], got {tuple(weight.shape)}")
    check_last_dim_contiguous("x", x)
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        check_last_dim_contiguous("residual", residual)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens:
        block = next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            residual_out,
            eps,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=max(1, min(16, block // 256)),
        )
    return out, (residual_out if residual is not None else x)
