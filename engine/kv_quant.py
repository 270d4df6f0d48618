"""The KV cache's storage dtype: the model's own, or 8-bit floats with scales.

With ``kv_cache_dtype="fp8"`` (``fp8_e4m3``) or ``"fp8_e5m2"`` every key and
value is stored as ``clamp(x / scale, -max, max)`` in that 8-bit float type and
read back as ``stored * scale`` in float32, where attention is computed
(``kernels.reference.quantize_kv`` / ``dequantize_kv`` define the maths).

Scales are per tensor: one ``k_scale`` and one ``v_scale`` for the whole cache
(every layer and head). Tandem has no calibration step, so both are 1.0, as in
vLLM when a checkpoint carries no KV scales: e4m3 then holds values up to 448
with a 3-bit mantissa (about 2 significant decimal digits), e5m2 up to 57344
with a 2-bit mantissa. SmolLM2's keys and values stay under 20 in magnitude
(measured on a prompt), well inside the range, so the error is the mantissa's
rounding; anything beyond the range is clamped, never turned into NaN. The
scales travel in the KV wire header so that a future calibrated cache cannot be
read with the wrong ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import KV_DTYPE_SIZES, resolve_kv_cache_dtype
from engine.dtypes import torch_dtype

FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class KVCacheSpec:
    """What one worker's cache is stored in: a dtype name of
    ``engine.config.KV_DTYPE_SIZES`` and the per-tensor scales."""

    name: str
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in KV_DTYPE_SIZES:
            raise ValueError(f"unknown KV cache dtype {self.name!r}")
        if not (self.k_scale > 0 and self.v_scale > 0):
            raise ValueError(f"KV scales must be positive, got {self.k_scale}, {self.v_scale}")

    @classmethod
    def of(cls, kv_cache_dtype: str, model_dtype: str) -> KVCacheSpec:
        """The spec for an engine's ``cache.kv_cache_dtype`` and resolved ``dtype``."""
        return cls(resolve_kv_cache_dtype(kv_cache_dtype, model_dtype))

    @property
    def fp8(self) -> bool:
        return self.name in FP8_DTYPES

    @property
    def torch_dtype(self) -> torch.dtype:
        return FP8_DTYPES[self.name] if self.fp8 else torch_dtype(self.name)

    @property
    def element_size(self) -> int:
        return KV_DTYPE_SIZES[self.name]

    @property
    def scales(self) -> tuple[float, float]:
        return (self.k_scale, self.v_scale)


def check_kv_cache_support(spec: KVCacheSpec, backend: str, device: torch.device) -> None:
    """ValueError at start for an 8-bit cache the backend cannot run here.

    The torch backend widens fp8 with torch ops, which every device has. The
    Triton kernels convert fp8 in registers, which NVIDIA GPUs do from compute
    capability 8.9 (Ada, Hopper) on; under the CPU interpreter (tests) too.
    """
    if not spec.fp8 or backend != "triton" or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"kv_cache_dtype {spec.name} with the Triton backend needs a GPU of compute "
            f"capability 8.9 or newer, this one is {major}.{minor}; use kv_cache_dtype='auto' "
            "or attention_backend='torch'"
        )
