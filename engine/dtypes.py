"""The engine's dtype names (``engine.config.DTYPES``) as torch dtypes.

The names and their sizes are said once, in engine/config.py, which must stay
importable without torch (the gateway uses it); this is the one mapping of
those names to torch, for the modules that have torch anyway.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine.config import DTYPE_SIZES, DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
assert all(TORCH_DTYPES[name].itemsize == size for name, size in DTYPE_SIZES.items())


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an engine dtype name; ValueError for any other name."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None


def resolve_dtype(name: str, device: str) -> str:
    """The dtype an engine asked for ``name`` runs in on ``device``: ``name``
    itself, or for "auto" the fastest one the hardware computes natively."""
    if name != "auto":
        torch_dtype(name)  # ValueError for an unknown name
        return name
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (oneDNN uses them).
    Elsewhere bf16 is emulated and slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: no way to tell cheaply, stay exact
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def cpu_is_intel() -> bool:
    """GenuineIntel: MKL takes its fast paths only there."""
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
