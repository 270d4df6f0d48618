"""Input checks shared by the kernel launchers.

A bad argument is a ``ValueError`` that names it, raised before anything is
launched: never an ``assert`` (gone under ``-O``) and never a Triton compile
error or an out-of-bounds read on the device.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# What a paged cache may be stored in: a float dtype, or 8-bit floats with a
# per-tensor scale (the kernels widen those on load).
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {allowed}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the kernel runs on {device}")
    return t


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # NOTE: the kernels index the last dimension with a unit stride so that
    # loads vectorize; every other dimension may be strided.
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def check_cache_pair(k_cache: object, v_cache: object) -> tuple[int, int, int, int]:
    """Both caches [num_blocks, block_size, num_kv_heads, head_dim], same
    shape and dtype, contiguous. Returns that shape."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=CACHE_DTYPES, device=k_cache.device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {cache.stride()}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The caller's output buffer, or a new one shaped like ``like``."""
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    check_tensor("out", out, ndim=like.dim(), dtypes=(like.dtype,), device=like.device)
    if out.shape != like.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(like.shape)}")
    check_last_dim_contiguous("out", out)
    return out


def check_tile(name: str, value: int, minimum: int = 16) -> int:
    if not isinstance(value, int) or value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")
    return value


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def lowp_dot(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``tl.dot`` may take 16-bit operands as loaded.

    Softmax and accumulation are always float32. On a GPU the two matmuls run
    on the 16-bit operands (exact products, fp32 accumulation), which doubles
    tensor-core throughput over tf32. The CPU interpreter computes bfloat16
    wrongly, so there the operands are widened to float32 first; float16 is
    fine in the interpreter and is what the tests use to cover this path.
    """
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and device.type != "cpu"


def query_dtypes(cache_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The query dtypes attention accepts over a cache of ``cache_dtype``: its
    own, or any float dtype over an 8-bit cache."""
    return FLOAT_DTYPES if cache_dtype in FP8_DTYPES else (cache_dtype,)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an 8-bit cache dtype (0.0 for any other)."""
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else 0.0
