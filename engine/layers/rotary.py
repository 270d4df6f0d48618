"""Rotary position embedding with the scalings Llama-family configs use."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.layers import cpu_ops
from kernels import reference

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(
        f"unsupported rope scaling {kind!r}; Tandem supports {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: stretch long wavelengths by ``factor``, keep short ones,
    and blend linearly in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None,
        fused: bool = False,
    ) -> None:
        super().__init__()
        if fused:
            from kernels.rotary import apply_rotary  # imports triton: only where it runs

            self._apply = apply_rotary
        else:
            self._apply = reference.apply_rotary
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [max_position, head_dim // 2]. Plain attributes, not buffers, so that
        # casting the model to half precision leaves them in float32.
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``q`` and ``k``; on the CPU (bfloat16, float32) rotated in place."""
        if (self._apply is reference.apply_rotary and cpu_ops.supports(q)
                and cpu_ops.supports(k) and self.cos.device == q.device):
            cpu_ops.rotary_(positions, q, k, self.cos, self.sin)
            return q, k
        cos, sin = self.cos[positions], self.sin[positions]
        return self._apply(q, cos, sin), self._apply(k, cos, sin)
