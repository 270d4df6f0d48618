"""Write a batch's new keys and values into their paged-cache slots.

One program per token copies all of its kv heads, so a token's row lands in
the cache with contiguous stores. Same semantics as ``reference.store_kv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cache_pair,
    check_last_dim_contiguous,
    check_tensor,
    fp8_max,
    next_power_of_2,
)


@triton.jit
def _round_to_fp8(x, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """``x`` (float32, within the fp8 range) rounded to the nearest fp8 value,
    ties to even, still in float32: the conversion that follows is then exact.

    NOTE: the Triton interpreter's float32 -> fp8 rounding drops the carry when
    the mantissa rounds up (7.9 becomes 4.0); rounding here first makes the
    stored bytes the same as torch's on every device.

    The magnitude is rounded and the sign put back, so that a negative value
    that rounds to zero stays -0 (byte 0x80), as torch's cast keeps it.
    """
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)  # subnormals share MIN_EXP's step
    step = ((exp - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds to an integer, ties even
    rounded = ((tl.abs(x) / step + magic) - magic) * step
    sign = (bits >> 31) << 31  # arithmetic shift: the sign bit alone
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,  # block_size * num_kv_heads * head_dim: the cache is contiguous
    stride_cache_head,
    k_scale,  # an fp8 cache stores x / scale, clamped to +-FP8_MAX
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0.0: the cache is in a float dtype
    FP8_MANTISSA: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    # NOTE: a contiguous cache makes block * block_stride + offset * slot_stride
    # equal to slot * slot_stride.
    dst = slot * stride_cache_slot + heads * stride_cache_head + dims

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    # Through float32: the interpreter converts bfloat16 only to and from float32.
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    if FP8_MAX > 0:
        k = tl.minimum(tl.maximum(k / k_scale, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v / v_scale, -FP8_MAX), FP8_MAX)
        k = _round_to_fp8(k, FP8_MANTISSA, FP8_MIN_EXP)
        v = _round_to_fp8(v, FP8_MANTISSA, FP8_MIN_EXP)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = do not store
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's key and value into its cache slot (in place); an
    fp8 cache gets ``reference.quantize_kv`` of them with the scales.

    Slots must be below ``num_blocks * block_size``; that is not checked,
    because checking would read the device tensor back to the host.
    """
    _, _, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    device = k_cache.device
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device)
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != expected:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {expected} "
                "(num_tokens from slot_mapping, heads and head_dim from the cache)"
            )
        check_last_dim_contiguous(name, t)
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    heads_pad, dim_pad = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        float(k_scale),
        float(v_scale),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=heads_pad,
        DIM_PAD=dim_pad,
        FP8_MAX=fp8_max(k_cache.dtype),
        FP8_MANTISSA=3 if k_cache.dtype == torch.float8_e4m3fn else 2,
        FP8_MIN_EXP=-6 if k_cache.dtype == torch.float8_e4m3fn else -14,
        num_warps=max(1, min(8, heads_pad * dim_pad // 512)),
    )
