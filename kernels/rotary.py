"""Rotary position embedding in the "rotate half" layout of HF Llama.

One program per token rotates every head: pairs (i, i + head_dim / 2) by the
token's angle. Same semantics as ``reference.apply_rotary``.
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
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    c = tl.load(cos_ptr + token * stride_ct + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_st + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    x1_ptrs = x_ptr + token * stride_xt + heads * stride_xh + dims
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1_ptrs = out_ptr + (token * NUM_HEADS + heads) * (2 * HALF) + dims
    dtype = out_ptr.dtype.element_ty
    tl.store(o1_ptrs, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(o1_ptrs + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim // 2]
    sin: torch.Tensor,
) -> torch.Tensor:  # a new contiguous tensor shaped like x
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    check_last_dim_contiguous("x", x)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
        if tuple(t.shape) != (num_tokens, head_dim // 2):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {(num_tokens, head_dim // 2)}"
            )
        check_last_dim_contiguous(name, t)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        heads_pad, half_pad = next_power_of_2(num_heads), next_power_of_2(head_dim // 2)
        _rotary_kernel[(num_tokens,)](
            x,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            sin.stride(0),
            NUM_HEADS=num_heads,
            HALF=head_dim // 2,
            HEADS_PAD=heads_pad,
            HALF_PAD=half_pad,
            num_warps=max(1, min(8, heads_pad * half_pad // 512)),
        )
    return out
