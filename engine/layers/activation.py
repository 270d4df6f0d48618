"""SwiGLU's gate: ``silu(gate) * up`` of a fused ``[gate | up]`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers import cpu_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2 * inner] -> [..., inner]
    if x.dim() == 2 and cpu_ops.supports(x):
        return cpu_ops.silu_and_mul(x)  # one pass instead of silu, a temporary, and mul
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
